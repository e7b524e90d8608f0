"""`moe-tpu data prepare` and `moe-tpu sample` are the trainer's commands under the moe-tpu name."""

import json

from cli_helpers import invoke


def test_data_prepare_writes_a_dataset_and_sample_names_a_missing_checkpoint(tmp_path):
    (tmp_path / "a.txt").write_text("one small document\nand another one\n" * 50)
    code, _, err = invoke("data", "prepare", str(tmp_path / "a.txt"), "--lines", "-o", str(tmp_path / "ds"),
                          "--vocab-size", "280", "--quiet")
    assert code == 0, err
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["documents"] == 100 and manifest["vocab_size"] <= 280
    code, _, err = invoke("data", "prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "ds"), "--quiet")
    assert code == 2 and "already holds a dataset" in err
    code, _, err = invoke("sample", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "hi")
    assert code == 2 and f"--checkpoint {tmp_path / 'nothing'} does not exist" in err
