"""`sample` takes any input calmly (issue 35, class 6 and class 4's tokenizer): every limit is refused
with exit 2 naming the flag and value before the checkpoint is read (seeds of any size:
test_trainer_sample.py), a missing dataset or a directory without checkpoints is one clean line, and a
--tokenizer other than the dataset's is refused with both fingerprints unless --any-tokenizer."""

import json

import numpy as np
import pytest
from array_record.python import array_record_module
from click.testing import CliRunner

from trainer.config import load_config
from trainer.prepare import fingerprint, train_bpe
from trainer.sample import sample_command


def sample(directory, *args):
    return CliRunner().invoke(sample_command, ["--checkpoint", str(directory), *map(str, args)])


def refused(result, *needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    for needle in needles:
        assert needle in result.output, result.output


@pytest.mark.parametrize(("args", "needles"), [
    (["--temperature", "nan"], ["--temperature nan"]),
    (["--temperature", "inf"], ["--temperature inf"]),
    (["--top-k", "257"], ["--top-k 257", "model.vocab_size=256"]),
    (["--prompt", "1 -2 300"], ["token id -2 is outside"]),
    (["--prompt", "5 300 -2"], ["token id 300 is outside"]),
    (["--prompt", "\udcff\udcfe"], ["--prompt b'\\xff\\xfe' is not UTF-8 text"]),
    (["--prompt", "1 2 x " + "3 " * 5000], ["got 'x' (word 3 of 5003)"]),
    (["--tokens", 2**40], [f"--tokens {2**40}", "2,147,483,647 positions"]),
    (["--tokens", 10**9], [f"--tokens {10**9}", "key/value cache", "can hold"]),
    (["--seed", 2**70], ["'--seed'", str(2**70)]),
    (["--seed", -1], ["'--seed'"]),
])
def test_limits_are_refused_naming_the_flag_and_value(trained_tiny, args, needles):
    prompt = [] if "--prompt" in args else ["--prompt", "1 2 3"]
    refused(sample(trained_tiny.output_dir, *prompt, *args), *needles)


@pytest.fixture(scope="module")
def records_run(tmp_path_factory):
    """A run's directory on a prepared dataset (its tokenizer trained on a few lines), no checkpoint in it,
    and a tokenizer trained on other text: the tokenizer check comes before any checkpoint is read."""
    tmp = tmp_path_factory.mktemp("records-run")
    ds = tmp / "ds"
    ds.mkdir()
    ours = train_bpe(iter(["the cat sat on the mat"] * 20), 300)
    ours.save(str(ds / "tokenizer.json"))
    other = train_bpe(iter(["zebras quietly graze at dawn"] * 20), 300)
    other.save(str(tmp / "other.json"))
    writer = array_record_module.ArrayRecordWriter(str(ds / "train-00000.array_record"), "group_size:1")
    writer.write(np.arange(1, 20, dtype=np.uint16).tobytes())
    writer.close()
    (ds / "manifest.json").write_text(json.dumps({
        "format": "moe-tpu-dataset", "version": 1, "vocab_size": 300, "eod_id": 0, "token_dtype": "uint16",
        "documents": 1, "tokens": 19, "tokenizer": {"file": "tokenizer.json", "fingerprint": fingerprint(ours)},
        "shards": [{"file": "train-00000.array_record", "documents": 1, "tokens": 19}]}))
    run = tmp / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = load_config("tiny", ["data.source=records", f"data.path={ds}", "model.vocab_size=300"])
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    return run, tmp / "other.json", fingerprint(ours), fingerprint(other)


def test_a_tokenizer_from_another_dataset_is_refused_with_both_fingerprints(records_run):
    run, other, ours, theirs = records_run
    refused(sample(run, "--prompt", "the cat", "--tokenizer", other), f"--tokenizer {other}", ours, theirs,
            "--any-tokenizer")
    past_the_tokenizer = f"{run / 'checkpoints'} holds no checkpoint"  # the next check: none was written
    refused(sample(run, "--prompt", "the cat", "--tokenizer", other, "--any-tokenizer"), past_the_tokenizer)
    refused(sample(run, "--prompt", "the cat", "--tokenizer", run.parent / "ds" / "tokenizer.json"),
            past_the_tokenizer)


def test_a_missing_dataset_and_a_directory_without_checkpoints_are_one_clean_message(records_run, tmp_path):
    run, *_ = records_run
    gone = tmp_path / "gone"
    (gone / "checkpoints").mkdir(parents=True)
    cfg = json.loads((run / "config.json").read_text())
    cfg["data"]["path"] = str(tmp_path / "nowhere")
    (gone / "config.json").write_text(json.dumps(cfg))
    refused(sample(gone, "--prompt", "the cat"), f"data.path '{tmp_path / 'nowhere'}' holds no manifest.json",
            "--tokenizer FILE")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    refused(sample(bare, "--prompt", "1"), f"--checkpoint {bare} holds no checkpoint")


def test_a_prompt_longer_than_the_models_context_is_cut_to_its_last_tokens_saying_so(trained_tiny):
    """5,000 tokens on tiny (trained on 64): it took minutes of prefill, silently; now its last 64 are
    continued, and the command says so."""
    result = sample(trained_tiny.output_dir, "--prompt", "3 " * 5000, "--tokens", "2", "--temperature", "0")
    assert result.exit_code == 0, result.output
    # the text alone on stdout: a newline after it would read as one the model wrote (stderr ends the line)
    assert len(result.stdout.split()) == 2 and not result.stdout.endswith("\n")
    assert ("--prompt: its 5,000 tokens exceed the model's context (data.seq_len=64, the length it was trained "
            "on): its last 64 are continued") in result.output


def test_a_dataset_prepared_again_after_training_is_noticed_where_its_tokenizer_is_read(trained_on_prepared,
                                                                                       tmp_path):
    """The run's dataset re-prepared at the same path with another tokenizer: its ids would decode to other
    text, silently; sample refuses, naming both fingerprints (--any-tokenizer takes it all the same)."""
    import shutil

    from trainer.prepare import prepare_command

    run = tmp_path / "out"
    shutil.copytree(trained_on_prepared.output_dir, run)
    config = json.loads((run / "config.json").read_text())
    config["data"]["path"] = str(tmp_path / "ds")
    (run / "config.json").write_text(json.dumps(config))
    (tmp_path / "docs.txt").write_text("".join(f"other words {i} here\n" for i in range(300)))
    again = CliRunner().invoke(prepare_command, [str(tmp_path / "docs.txt"), "--lines", "-o", str(tmp_path / "ds"),
                                                 "--vocab-size", "300", "--quiet"])
    assert again.exit_code == 0, again.output
    refused(sample(run, "--prompt", "the cat", "--tokens", "2"),
            f"the dataset at data.path '{tmp_path / 'ds'}' is not the one the run trained on", "prepared again")
    # The server reads the tokenizer the same way, and refuses the same way, before anything is built.
    from trainer.run_loader import RunError
    from trainer.serve.startup import load

    with pytest.raises(RunError, match=f"the dataset at data.path '{tmp_path / 'ds'}' is not the one the run"):
        load(str(run), tokenizer_path=None, mesh_text=None, slots=1, max_len=32, chunk=16, kv_dtype=None,
             quantized=None, device_memory_gb=None, progress=print)
    # The run as trained (5% held out: its fingerprint carries that too) samples as ever, from another directory
    # than the one it trained in with data.path=ds: its config.json keeps that path absolute.
    config = json.loads((trained_on_prepared.output_dir / "config.json").read_text())
    assert config["data"]["path"] == str(trained_on_prepared.dataset)
    assert sample(trained_on_prepared.output_dir, "--prompt", "the cat", "--tokens", "2").exit_code == 0


def test_a_config_whose_model_no_device_holds_is_blamed_not_the_tokens(trained_tiny, tmp_path):
    """config.json edited to a vocabulary of 10**9: it was '--tokens 64: ... ask for fewer', which no
    --tokens could mend."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_tiny.output_dir, run)
    config = json.loads((run / "config.json").read_text())
    config["model"]["vocab_size"] = 10**9
    (run / "config.json").write_text(json.dumps(config))
    refused(sample(run, "--prompt", "1 2"), "the run's model (tiny: model.vocab_size=1,000,000,000", "of weights",
            "is its config.json the one the trainer wrote?")


def test_a_serving_mesh_that_needs_more_devices_says_how_to_fake_them_on_cpu(trained_tiny):
    from trainer.serve.startup import ServeError, load

    with pytest.raises(ServeError, match=r"--mesh data=2,expert=8 needs 16 devices, but there are 8; on CPU, add "
                                         r"--devices 16 to run on 16 fake devices"):
        load(str(trained_tiny.output_dir), tokenizer_path=None, mesh_text="data=2,expert=8", slots=1, max_len=32,
             chunk=16, kv_dtype=None, quantized=None, device_memory_gb=None, progress=print)
