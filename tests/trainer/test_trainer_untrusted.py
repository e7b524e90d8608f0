"""The trainer's inputs as untrusted: manifests checked field by field, paths kept inside the dataset,
FIFOs and devices refused unopened, token arrays checked against their headers; a dataset known by its
content; configs with duplicate keys or a base that is no file; models that cannot fit; terminal escapes;
a checkpoint that the disk cannot hold. Each a clear message and its exit code, never a hang."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module
from click.testing import CliRunner

from trainer.cli import train_command
from trainer.config import ConfigError, load_config
from trainer.data import open_data
from trainer.manifest import DataError, dataset_fingerprint, load_manifest
from trainer.metrics import Reporter
from trainer.resume import check_resumable

EOD = 0


def write_dataset(directory, docs, vocab=300, fingerprint="sha256:aa"):
    """A prepared dataset of one shard, written directly."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = array_record_module.ArrayRecordWriter(str(directory / "train-00000.array_record"), "group_size:1")
    for doc in docs:
        writer.write(np.asarray(doc, np.uint16).tobytes())
    writer.close()
    manifest = {"format": "moe-tpu-dataset", "version": 1, "vocab_size": vocab, "eod_id": EOD,
                "token_dtype": "uint16", "documents": len(docs), "tokens": sum(map(len, docs)),
                "tokenizer": {"file": "tokenizer.json", "fingerprint": fingerprint},
                "shards": [{"file": "train-00000.array_record", "documents": len(docs),
                            "tokens": sum(map(len, docs))}]}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


DOCS = [list(range(1, 20))] * 4


def records(path, *extra):
    return load_config("tiny", ["data.source=records", f"data.path={path}", "model.vocab_size=300",
                                "data.seq_len=16", "data.global_batch_size=4", *extra])


def edit_manifest(directory, **changes):
    manifest = json.loads((directory / "manifest.json").read_text())
    for key, value in changes.items():
        if key.startswith("shard_"):
            manifest["shards"][0][key.removeprefix("shard_")] = value
        else:
            manifest[key] = value
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("case, message", [
    ("vocab as text", r"'vocab_size' must be an integer between 2 and \d+, got '300'"),
    ("eod past vocab", r"'eod_id' must be an integer between 0 and 299, got 300"),
    ("float tokens", r"'token_dtype' must be uint16 .* or uint32, got 'float32'"),
    ("shard up and out", r"shards\[0\].file '../train-00000.array_record' leads out of the dataset's directory"),
    ("absolute shard", r"shards\[0\].file '/etc/hostname' leads out of the dataset's directory"),
    ("shard link out", r"shards\[0\].file 'elsewhere.array_record' is a link out of the dataset's directory"),
    ("tokenizer out", r"tokenizer.file '../tokenizer.json' leads out"),
    ("negative count", r"shards\[0\]: 'documents' must be an integer at least 0, got -1"),
    ("shard FIFO", r"the dataset shard '.*/fifo.array_record' is a FIFO, not a file"),
    ("manifest FIFO", r"data.path '.*/manifest.json' is a FIFO, not a file"),
    ("truncated shard", r"train-00000.array_record holds 4 documents, its manifest says 9: it was truncated"),
    ("corrupt shard", r"train-00000.array_record cannot be read \(truncated or corrupt\?\)"),
    ("newer version", r"manifest.json is of format version 2; this trainer reads version 1: prepare the dataset"),
    ("version as text", r"'version' must be an integer at least 1, got '1'"),
    ("uint32 over uint16 shards", r"train-00000.array_record holds a document of 38 bytes, not a whole number of "
                                  r"uint32 tokens \(4 bytes each\): the manifest's 'token_dtype' \(uint32\) does not "
                                  r"match"),
    ("largest id past vocab", r"'max_token_id' must be an integer between 0 and 299, got 1000000"),
    ("total as text", r"'tokens' must be an integer at least 0, got 'many'"),
])
def test_a_manifest_is_checked_field_by_field_and_its_paths_stay_inside(tmp_path, case, message):
    ds = write_dataset(tmp_path / "ds", DOCS)
    shutil.copy(ds / "train-00000.array_record", tmp_path / "train-00000.array_record")
    change = {"vocab as text": {"vocab_size": "300"}, "eod past vocab": {"eod_id": 300},
              "float tokens": {"token_dtype": "float32"},
              "shard up and out": {"shard_file": "../train-00000.array_record"},
              "absolute shard": {"shard_file": "/etc/hostname"},
              "shard link out": {"shard_file": "elsewhere.array_record"},
              "tokenizer out": {"tokenizer": {"file": "../tokenizer.json", "fingerprint": ""}},
              "negative count": {"shard_documents": -1}, "shard FIFO": {"shard_file": "fifo.array_record"},
              "truncated shard": {"shard_documents": 9}, "newer version": {"version": 2},
              "version as text": {"version": "1"}, "uint32 over uint16 shards": {"token_dtype": "uint32"},
              "largest id past vocab": {"max_token_id": 10**6}, "total as text": {"tokens": "many"}}.get(case, {})
    edit_manifest(ds, **change)
    if case == "shard link out":
        (ds / "elsewhere.array_record").symlink_to(tmp_path / "train-00000.array_record")
    elif case == "shard FIFO":
        os.mkfifo(ds / "fifo.array_record")  # opened, it would block the trainer for ever
    elif case == "manifest FIFO":
        (ds / "manifest.json").unlink()
        os.mkfifo(ds / "manifest.json")
    elif case == "corrupt shard":
        (ds / "train-00000.array_record").write_bytes(os.urandom(3000))
    with pytest.raises(DataError, match=message):
        open_data(records(ds), seed=0)


@pytest.mark.parametrize("case, message", [
    ("bool", r"holds bool values; token ids must be integers"),
    ("float", r"holds float32 values; token ids must be integers"),
    ("complex", r"holds complex64 values"),
    ("short", r"is truncated: its header says 4,096 tokens \(8,192 bytes\), the file holds 1,000 bytes of them"),
    ("/dev/zero", r"data.path '/dev/zero' is a device, not a file"),
    ("fifo", r"data.path '.*fifo.npy' is a FIFO, not a file"),
])
def test_token_arrays_must_be_integers_as_long_as_their_header_says(tmp_path, case, message):
    path = tmp_path / ("fifo.npy" if case == "fifo" else "t.npy")
    if case in ("bool", "float", "complex"):
        np.save(path, np.ones(4096, {"bool": np.bool_, "float": np.float32, "complex": np.complex64}[case]))
    elif case == "short":
        np.save(path, np.ones(4096, np.uint16))
        with open(path, "r+b") as f:
            f.truncate(128 + 1000)  # the header (128 bytes) stays, the tokens are cut
    elif case == "fifo":
        os.mkfifo(path)
    else:
        path = case
    cfg = load_config("tiny", ["data.source=tokens", f"data.path={path}", "data.seq_len=16"])
    with pytest.raises(DataError, match=message):
        open_data(cfg, seed=0)


def test_token_ids_that_int32_cannot_hold_are_refused_not_wrapped(tmp_path):
    tokens = np.arange(4096, dtype=np.int64) % 200
    tokens[5] = 2**32 + 7  # int32 would read 7, a valid id
    np.save(tmp_path / "t.npy", tokens)
    train, _ = open_data(load_config("tiny", ["data.source=tokens", f"data.path={tmp_path}/t.npy",
                                              "data.seq_len=16", "data.global_batch_size=4"]), seed=None or 0)
    with pytest.raises(DataError, match=r"holds token id 4294967303 \(row 0\): no vocabulary holds it"):
        for _ in range(300):
            next(train)
    train.close()


def test_a_dataset_is_known_by_its_content_not_its_path(tmp_path):
    first = write_dataset(tmp_path / "a", DOCS)
    data, _ = open_data(records(first), seed=0)
    saved = data.state()
    data.close()
    assert saved["source"].startswith("dataset:sha256:") and str(first) not in saved["source"]
    # The same dataset moved: the same fingerprint, and resuming is allowed.
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    again, _ = open_data(records(moved), seed=0)
    assert again.fingerprint == saved["source"]
    check_resumable(saved, records(moved), again, 10, Reporter(None, is_writer=False))
    again.close()
    # Another corpus under that same path: refused, both fingerprints named.
    shutil.rmtree(moved)
    write_dataset(moved, [list(range(20, 40))] * 4)
    other, _ = open_data(records(moved), seed=0)
    with pytest.raises(ConfigError, match=rf"the data is the dataset with fingerprint {saved['source']} in the "
                                          rf"checkpoint, the dataset with fingerprint {other.fingerprint} now"):
        check_resumable(saved, records(moved), other, 10, Reporter(None, is_writer=False))
    other.close()
    assert dataset_fingerprint(load_manifest(str(moved))) == other.fingerprint


def test_an_eval_set_from_another_tokenizer_is_refused_naming_both(tmp_path):
    train = write_dataset(tmp_path / "train", DOCS, fingerprint="sha256:one")
    held = write_dataset(tmp_path / "eval", DOCS, fingerprint="sha256:two")
    cfg = records(train, f"data.eval_path={held}", "train.eval_every=5")
    with pytest.raises(DataError, match=r"was prepared with another tokenizer \(sha256:two, end-of-document id 0\) "
                                        r"than data.path .* \(sha256:one"):
        open_data(cfg, seed=0, with_eval=True)


def train(args):
    return CliRunner().invoke(train_command, ["--devices", "1", "--steps", "1", *map(str, args)])


@pytest.mark.parametrize("case, message", [
    ("duplicate key", r"config .*dup.yaml: the key 'model.d_model' appears twice \(lines 2 and 3\)"),
    ("base FIFO", r"the base of .*base.yaml, .*fifo, is a FIFO, not a config file"),
    ("base /dev/zero", r"the base of .*base.yaml, /dev/zero, is a device, not a config file"),
    ("base directory", r"the base of .*base.yaml, .*, is a directory, not a config file"),
    ("batch overflow", r"data.global_batch_size x \(data.seq_len \+ 1\) = 99,999,999,999,999,999,999 x 65 tokens"),
    ("cannot fit", r"the model cannot fit: .* GiB per device on the mesh .*, more than the host's available memory"),
    ("escapes", r"data.path '/x\\x1b\[2Jy' does not exist"),
    ("metrics FIFO", r"cannot write the metrics file .*metrics.jsonl: it is a FIFO, not a file"),
    ("status FIFO", r"the status file .*/fifo is a FIFO, not a file: name a file"),
])
def test_round_two_leftovers_are_usage_errors_with_clear_messages(tmp_path, case, message):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dup.yaml").write_text("model:\n  d_model: 64\n  d_model: 128\n")
    base = {"base FIFO": tmp_path / "fifo", "base /dev/zero": "/dev/zero", "base directory": tmp_path}.get(case)
    (tmp_path / "base.yaml").write_text(f"base: {base}\n")
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / "metrics.jsonl")
    args = {"duplicate key": ["--config", tmp_path / "dup.yaml"],
            "batch overflow": ["--set", "data.global_batch_size=99999999999999999999"],
            "cannot fit": ["--set", "model.d_model=4000000"],
            "escapes": ["--set", "data.source=tokens", "--set", "data.path=/x\x1b[2Jy"],
            "metrics FIFO": ["--output-dir", tmp_path / "out"],
            "status FIFO": ["--status-file", tmp_path / "fifo"]}.get(case, ["--config", tmp_path / "base.yaml"])
    result = train(args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "\x1b" not in result.output
    assert __import__("re").search(message, result.output), result.output
    assert (tmp_path / "fifo").is_fifo()  # the status file's rename did not replace it


def test_a_fifo_as_the_plots_metrics_or_the_servers_chat_template_is_refused_unopened(tmp_path, capsys):
    """Both opened it and waited for a writer for ever."""
    from trainer.plot import main as plot
    from trainer.serve.cli import _chat_template
    from trainer.serve.startup import ServeError

    os.mkfifo(tmp_path / "fifo")
    assert plot([str(tmp_path / "fifo"), str(tmp_path / "out.png")]) == 2
    assert f"cannot read {tmp_path / 'fifo'}: it is a FIFO, not a file" in capsys.readouterr().err
    with pytest.raises(ServeError, match=f"--chat-template {tmp_path / 'fifo'} is a FIFO, not a file"):
        _chat_template(str(tmp_path / "fifo"))


FILE_SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))
from trainer.cli import main
main(sys.argv[1:])
"""


@pytest.mark.compile_bound
def test_a_checkpoint_the_disk_cannot_hold_names_its_step_and_leaves_no_temporary_directory(tmp_path):
    out = tmp_path / "run"
    # The compilation cache's own writes fail under the limit too: their warnings are not what is tested.
    environment = {**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"}
    run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, "--devices", "1", "--steps", "2", "--set",
                          "train.checkpoint_every=1", "--output-dir", str(out), "--metrics", str(tmp_path / "m.jsonl")],
                         capture_output=True, text=True, timeout=300, env=environment)
    assert run.returncode == 1, run.stderr
    assert f"cannot save the checkpoint at step 1 to {out}/checkpoints: File too large" in run.stderr
    assert "Traceback" not in run.stderr and "ERROR" not in run.stderr
    assert not [p for p in (out / "checkpoints").iterdir() if "tmp" in p.name]


def test_a_plot_of_rows_edited_to_sizes_no_axis_holds_leaves_them_out(tmp_path, capsys):
    """An expert load of 1e308 and -1e308 (its colour range overflows), NaN and a step of 10**30 were an
    internal error in matplotlib ('Axis limits cannot be NaN or Inf')."""
    from trainer.plot import main as plot

    rows = ['{"step": 1, "loss": 3.0, "expert_load": [0.5, 0.5]}', '{"step": 2, "loss": NaN, "expert_load": '
            '[1e308, -1e308]}', '{"step": 3, "loss": 1e308, "tokens_per_s": -1e308, "expert_load": [NaN, 0.5]}',
            '{"step": 1000000000000000000000000000000, "loss": 2.0}', '{"step": 4, "loss": 2.5}']
    (tmp_path / "m.jsonl").write_text("\n".join(rows) + "\n")
    assert plot([str(tmp_path / "m.jsonl"), str(tmp_path / "p.png")]) == 0, capsys.readouterr().err
    assert "skipped 1 metric row(s)" in capsys.readouterr().err and (tmp_path / "p.png").stat().st_size > 0
