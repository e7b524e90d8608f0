"""trainer.sample (a client of the serving engine, tested in test_serve_engine.py): a trained `tiny` continues
the synthetic source with transitions the source allows; a directory without a checkpoint exits 2."""

import json
import os

from click.testing import CliRunner

from trainer.config import load_config
from trainer.data import make_source
from trainer.sample import sample_command


def test_a_trained_tiny_continues_the_source_with_allowed_transitions(trained_tiny, monkeypatch):
    """The checkpoint is named by a relative path, as a user types it (orbax itself takes absolute ones only). Through
    `moe-tpu --output json sample --weights int4` (the global flag reaches it; the weights stored as
    `serve --weights int4` stores them, trainer.serve.weights.restore_weights): the prompt's and the new ids, and
    their text."""
    from provision.cli import cli

    out = trained_tiny.output_dir  # 120 steps through the command line (tests/trainer/conftest.py)
    assert json.loads((out / "config.json").read_text())["name"] == "tiny"
    assert not (out / "profile").exists()  # no trace without --profile-steps
    source = make_source(load_config("tiny"), seed=0)
    prompt = source.rows(7, [0])[0][:16].tolist()
    monkeypatch.chdir(out.parent)
    result = CliRunner().invoke(cli, ["--output", "json", "sample", "--checkpoint", out.name, "--prompt",
                                      " ".join(map(str, prompt)), "--tokens", "300", "--seed", "1",
                                      "--weights", "int4"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["prompt_ids"], doc["weights"], doc["finish_reason"], doc["step"]) == (prompt, "int4", "length", 120)
    ids = doc["ids"]
    assert len(ids) == 300 and doc["text"] == " ".join(map(str, ids))
    allowed = {(s, int(t)) for s in range(source.succ_VxK.shape[0]) for t in source.succ_VxK[s]}
    pairs = list(zip([int(prompt[-1]), *ids], ids, strict=False))
    share = sum(p in allowed for p in pairs) / len(pairs)
    assert share >= 0.95, share
    assert "300 tokens from the checkpoint at step 120 (tiny, int4 weights)" in result.stderr
    assert "tokens/s" in result.stderr


def test_no_checkpoint_or_no_config_exits_2_naming_the_directory(tmp_path):
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty" / "config.json").write_text(json.dumps(load_config("tiny").to_dict()))
    (tmp_path / "fifo" / "checkpoints").mkdir(parents=True)
    os.mkfifo(tmp_path / "fifo" / "config.json")  # opened, it would wait for a writer for ever
    (tmp_path / "device" / "checkpoints").mkdir(parents=True)
    (tmp_path / "device" / "config.json").symlink_to("/dev/zero")  # read, it would never end
    for directory, needle in ((tmp_path / "empty", f"{tmp_path / 'empty' / 'checkpoints'} holds no checkpoint"),
                              (tmp_path / "fifo", f"the run's config '{tmp_path / 'fifo' / 'config.json'}' is a "
                                                  "FIFO, not a file"),
                              (tmp_path / "device", f"the run's config '{tmp_path / 'device' / 'config.json'}' is "
                                                    "a device, not a file"),
                              (tmp_path / "none", f"--checkpoint {tmp_path / 'none'} does not exist"),
                              (tmp_path, f"--checkpoint {tmp_path} holds no checkpoint")):
        result = CliRunner().invoke(sample_command, ["--checkpoint", str(directory), "--prompt", "1 2"])
        assert result.exit_code == 2, result.output
        assert needle in result.output and "Traceback" not in result.output


def test_sample_and_init_from_look_a_run_up_alike(tmp_path):
    """One lookup (trainer.outputs.RunDirectory.find) names a run for both, in the same words but the option's:
    an output directory, its checkpoints directory, and a `checkpoints` that is a file or missing (refused)."""
    import pytest

    from trainer.config import ConfigError
    from trainer.init_from import checkpoints_of

    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    assert checkpoints_of(str(run)) == str(run / "checkpoints")
    assert checkpoints_of(str(run / "checkpoints")) == str(run / "checkpoints")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "checkpoints").write_text("")  # a file: no checkpoints directory
    for bad in (odd, tmp_path / "none", run / "checkpoints" / "4"):
        with pytest.raises(ConfigError) as refused:
            checkpoints_of(str(bad))
        result = CliRunner().invoke(sample_command, ["--checkpoint", str(bad), "--prompt", "1 2"])
        assert result.exit_code == 2
        assert str(refused.value).replace("--init-from", "--checkpoint") in result.output, result.output
