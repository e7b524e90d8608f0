"""trainer.prepare: text, JSON lines and Parquet into ArrayRecord shards and a manifest; bad input exits 2;
a prepared corpus trains (eval loss under the tokens' unigram entropy), the evaluation reaches every report,
TensorBoard holds the metrics, and train.profile_steps leaves one trace."""

import json
import math
import os
import random
import shutil
import signal

import numpy as np
import pytest
from array_record.python import array_record_module
from click.testing import CliRunner
from tokenizers import Tokenizer

from trainer.cli import train_command
from text_corpus import corpus
from trainer.prepare import prepare_command

def prepare(args):
    return CliRunner().invoke(prepare_command, [*map(str, args), "--quiet"])


def read_documents(directory, manifest):
    docs = []
    for shard in manifest["shards"]:
        reader = array_record_module.ArrayRecordReader(str(directory / shard["file"]))
        docs += [np.frombuffer(r, manifest["token_dtype"]) for r in reader.read_all()]
        reader.close()
    return docs


def test_jsonl_text_and_parquet_in_shards_and_a_manifest_out(tmp_path):
    texts = corpus(1200)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    result = prepare([tmp_path / "docs.jsonl", "-o", tmp_path / "ds", "--vocab-size", "300", "--text-key", "body",
                      "--documents-per-shard", "500"])
    assert result.exit_code == 0, result.output
    assert "wrote 1,200 documents" in result.output and "tokens/s" in result.output
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 300 and manifest["token_dtype"] == "uint16" and manifest["tokenizer"]["trained"]
    assert [s["documents"] for s in manifest["shards"]] == [500, 500, 200]
    tokenizer = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert manifest["eod_id"] == tokenizer.token_to_id("<|endoftext|>")
    docs = read_documents(tmp_path / "ds", manifest)
    assert [tokenizer.decode(d.tolist()) for d in docs[:50]] == texts[:50]
    assert sum(map(len, docs)) == manifest["tokens"] and max(int(d.max()) for d in docs) == manifest["max_token_id"]

    # The same tokenizer by path, over text files (a document per line) and Parquet: the same ids.
    (tmp_path / "docs.txt").write_text("\n".join(texts[:100]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[:100]}), tmp_path / "docs.parquet")
    for name, extra in (("docs.txt", ["--lines"]), ("docs.parquet", [])):
        out = tmp_path / f"ds-{name}"
        result = prepare([tmp_path / name, "-o", out, "--tokenizer", tmp_path / "ds" / "tokenizer.json", *extra])
        assert result.exit_code == 0, result.output
        again = json.loads((out / "manifest.json").read_text())
        assert again["tokenizer"]["fingerprint"] == manifest["tokenizer"]["fingerprint"]
        assert not again["tokenizer"]["trained"]
        assert all(np.array_equal(a, b) for a, b in zip(read_documents(out, again), docs[:100], strict=True))


@pytest.mark.parametrize("case, needle", [
    ("missing tokenizer", "the tokenizer file {tmp}/none.json does not exist"),
    ("corrupt tokenizer", "the tokenizer file {tmp}/bad.json cannot be read"),
    ("no inputs", "input '{tmp}/*.none' matches no files"),
    ("no text key", "{tmp}/docs.jsonl line 1 has no text field 'text'"),
    ("no end token", "the tokenizer has no end-of-document token '<eod>'"),
    ("latin-1 text", "{tmp}/latin.txt line 2 is not UTF-8 text: byte 0xe9 at column 4 (byte offset 8 in the file)"),
    ("latin-1 whole file", "{tmp}/latin.txt line 2 is not UTF-8 text: byte 0xe9 at column 4 (byte offset 8 in"),
    ("NUL in text", "{tmp}/nul.txt line 2 holds a NUL byte at byte offset 8, which is not text"),
    ("UTF-16 text", "{tmp}/utf16.txt line 1 is not UTF-8 text: byte 0xff at column 1 (byte offset 0 in the file)"),
    ("surrogate bytes", "{tmp}/surrogate.txt line 1 is not UTF-8 text: byte 0xed at column 3 (byte offset 2"),
    ("surrogate escape", "{tmp}/surrogate.jsonl line 2 (byte offset 15): the field 'text' holds an unpaired "
                         "surrogate (\\udc80), which is not text"),
    ("NUL escape", "{tmp}/nul.jsonl line 1 (byte offset 0): the field 'text' holds a NUL, which is not text"),
    ("latin-1 JSON", "{tmp}/latin.jsonl line 1 is not UTF-8 text: byte 0xe9"),
    ("JSON number", "{tmp}/number.jsonl line 2: the field 'text' holds a number, not text"),
    ("deep JSON", "{tmp}/deep.jsonl line 1 nests too deep to read"),
    ("Parquet ints", "{tmp}/ints.parquet: the column 'text' holds int64, not text"),
    ("output is a file", "--output {tmp}/a.txt is a file, not a directory"),
    ("output under a file", "cannot create the output directory {tmp}/a.txt/ds: Not a directory (a part of the "
                            "path is a file)"),
    ("output empty", "--output is empty"),
    ("input directory", "input '{tmp}/corpus' is a directory: name its files, e.g. '{tmp}/corpus/*.jsonl'"),
    ("input FIFO", "input '{tmp}/pipe.txt' is a FIFO, not a file"),
    ("FIFO in a wildcard", "input '{tmp}/*.txt' matches {tmp}/pipe.txt, which is a FIFO, not a file"),
    ("tokenizer FIFO", "the tokenizer file {tmp}/pipe.txt is a FIFO, not a file"),
    ("tokenizer directory", "the tokenizer file {tmp}/corpus is a directory, not a file"),
    ("output FIFO", "--output {tmp}/pipe.txt is a FIFO, not a directory"),
    ("JSON list", "{tmp}/list.jsonl line 1 is a list, not an object: each line must be one object"),
])
def test_bad_input_exits_2_naming_the_file_or_key(tmp_path, case, needle):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    (tmp_path / "a.txt").write_text("some text here\n")
    (tmp_path / "latin.txt").write_bytes(b"fine\ncaf\xe9\n")
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (tmp_path / "nul.txt").write_bytes(b"fine\nnul\0here\n")
    (tmp_path / "utf16.txt").write_text("text\n", encoding="utf-16")
    (tmp_path / "surrogate.txt").write_bytes(b"ab\xed\xb2\x80cd\n")  # a lone surrogate's UTF-8-style bytes
    (tmp_path / "surrogate.jsonl").write_text('{"text": "ok"}\n{"text": "a\\udc80b"}\n')
    (tmp_path / "nul.jsonl").write_text('{"text": "a\\u0000b"}\n')
    (tmp_path / "number.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    (tmp_path / "deep.jsonl").write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "list.jsonl").write_text('["text", "hello"]\n')
    os.mkfifo(tmp_path / "pipe.txt")  # opened, it would wait for a writer for ever
    output = {"output is a file": tmp_path / "a.txt", "output under a file": tmp_path / "a.txt" / "ds",
              "output empty": "", "output FIFO": tmp_path / "pipe.txt"}.get(case, tmp_path / "out")
    args = {"latin-1 text": [tmp_path / "latin.txt", "--lines"], "latin-1 JSON": [tmp_path / "latin.jsonl"],
            "latin-1 whole file": [tmp_path / "latin.txt"], "NUL in text": [tmp_path / "nul.txt", "--lines"],
            "UTF-16 text": [tmp_path / "utf16.txt"], "surrogate bytes": [tmp_path / "surrogate.txt"],
            "surrogate escape": [tmp_path / "surrogate.jsonl"], "NUL escape": [tmp_path / "nul.jsonl"],
            "JSON number": [tmp_path / "number.jsonl"], "deep JSON": [tmp_path / "deep.jsonl"],
            "Parquet ints": [tmp_path / "ints.parquet"], "output is a file": [tmp_path / "docs.jsonl"],
            "output under a file": [tmp_path / "a.txt"], "output empty": [tmp_path / "a.txt"],
            "missing tokenizer": [tmp_path / "a.txt", "--tokenizer", tmp_path / "none.json"],
            "corrupt tokenizer": [tmp_path / "a.txt", "--tokenizer", tmp_path / "bad.json"],
            "no inputs": [f"{tmp_path}/*.none"],
            "no text key": [tmp_path / "docs.jsonl"],
            "no end token": [tmp_path / "a.txt", "--eod-token", "<eod>", "--vocab-size", "260"],
            "input directory": [tmp_path / "corpus"], "input FIFO": [tmp_path / "pipe.txt"],
            "FIFO in a wildcard": [f"{tmp_path}/*.txt"], "JSON list": [tmp_path / "list.jsonl"],
            "tokenizer FIFO": [tmp_path / "a.txt", "--tokenizer", tmp_path / "pipe.txt"],
            "tokenizer directory": [tmp_path / "a.txt", "--tokenizer", tmp_path / "corpus"],
            "output FIFO": [tmp_path / "a.txt"]}[case]
    result = prepare([*args, "-o", output])
    assert result.exit_code == 2, result.output
    assert needle.format(tmp=tmp_path) in result.output
    assert "Traceback" not in result.output and "Usage:" not in result.output  # the data is at fault, not argv
    assert not (tmp_path / "out").exists()  # nothing half-written: the directory it made is gone again
    assert (tmp_path / "a.txt").read_text() == "some text here\n"


def test_bad_text_replace_reads_what_is_not_text_as_the_replacement_character_and_counts_it(tmp_path):
    (tmp_path / "mixed.txt").write_bytes(b"caf\xe9 au lait\nnul\0byte\n")
    (tmp_path / "mixed.jsonl").write_text('{"text": "lone \\udc80 here"}\n')
    result = prepare([tmp_path / "mixed.txt", tmp_path / "mixed.jsonl", "--lines", "--bad-text", "replace",
                      "--vocab-size", "270", "-o", tmp_path / "out"])
    assert result.exit_code == 0, result.output
    assert "note: 3 byte(s) or character(s) that are not text" in result.output  # counted once, not per pass
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    texts = [tokenizer.decode(d.tolist()) for d in read_documents(tmp_path / "out", manifest)]
    assert texts == ["caf\ufffd au lait", "nul\ufffdbyte", "lone \ufffd here"]


UNREADABLE = """
import sys
from trainer.prepare import main
main(sys.argv[1:])
"""


@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) drops root's file-permission override")
def test_an_unreadable_input_and_an_unwritable_output_name_the_path_and_the_permission(tmp_path):
    """Root reads and writes whatever the mode bits say; the command runs without the capabilities that let
    it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), as any other user would. The unreadable file is named before
    a tokenizer is trained on the others."""
    import subprocess
    import sys

    (tmp_path / "a.txt").write_text("readable\n")
    (tmp_path / "b.txt").write_text("secret\n")
    (tmp_path / "b.txt").chmod(0o000)
    (tmp_path / "locked").mkdir(mode=0o555)
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []

    def run(*args):
        return subprocess.run([*drop, sys.executable, "-c", UNREADABLE, *map(str, args), "-q"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})

    unreadable = run(f"{tmp_path}/*.txt", "-o", tmp_path / "out")
    assert unreadable.returncode == 2, unreadable.stderr
    assert f"cannot read {tmp_path}/b.txt: Permission denied" in unreadable.stderr
    assert "trained" not in unreadable.stderr and not (tmp_path / "out").exists()
    unwritable = run(tmp_path / "a.txt", "-o", tmp_path / "locked" / "ds")
    assert unwritable.returncode == 2, unwritable.stderr
    assert f"cannot create the output directory {tmp_path}/locked/ds: Permission denied" in unwritable.stderr
    into = run(tmp_path / "a.txt", "-o", tmp_path / "locked")
    assert into.returncode == 2 and f"--output {tmp_path}/locked is not writable (permission denied)" in into.stderr


def test_a_second_prepare_into_a_directory_in_use_refuses_and_files_move_in_whole(tmp_path):
    from trainer.prepare import OutputDir

    (tmp_path / "a.txt").write_text("one line\nanother line\n")
    out = tmp_path / "ds"
    with OutputDir(str(out)):  # a prepare at work there (the lock is the directory's flock)
        busy = prepare([tmp_path / "a.txt", "--lines", "-o", out, "--vocab-size", "260"])
    assert busy.exit_code == 2 and f"another `data prepare` is writing to {out}" in busy.output
    # A link where the tokenizer goes, to a file of the user's: replaced, never written through.
    (tmp_path / "mine.json").write_text("my own file")
    (out / "tokenizer.json").symlink_to(tmp_path / "mine.json")
    done = prepare([tmp_path / "a.txt", "--lines", "-o", out, "--vocab-size", "260"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "mine.json").read_text() == "my own file" and not (out / "tokenizer.json").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "tokenizer.json", "train-00000.array_record"]
    again = prepare([tmp_path / "a.txt", "--lines", "-o", out, "--vocab-size", "260"])
    assert again.exit_code == 2 and "already holds a dataset" in again.output


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_or_sighup_mid_prepare_exits_with_its_code_and_leaves_nothing(tmp_path, monkeypatch, signum, code):
    from trainer import prepare as module

    (tmp_path / "a.txt").write_text("one line\nanother line\n")
    trained, before = module.train_bpe, signal.getsignal(signum)
    monkeypatch.setattr(module, "train_bpe", lambda *a: (os.kill(os.getpid(), signum), trained(*a))[1])
    for out in (tmp_path / "new", tmp_path / "existing"):
        (tmp_path / "existing").mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as exit_:
            module.main([str(tmp_path / "a.txt"), "--lines", "-o", str(out), "-q", "--vocab-size", "260"])
        assert exit_.value.code == code
    assert not (tmp_path / "new").exists() and list((tmp_path / "existing").iterdir()) == []
    assert signal.getsignal(signum) == before  # the handler it set is gone again


FILE_SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG) like on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
from trainer.prepare import main
main(sys.argv[1:])
"""


def test_a_disk_that_fills_up_is_a_runtime_error_that_leaves_nothing_half_written(tmp_path):
    import subprocess
    import sys

    (tmp_path / "a.txt").write_text("".join(f"line {i} of some text\n" for i in range(8000)))
    for out in (tmp_path / "new", tmp_path / "existing"):
        (tmp_path / "existing").mkdir(exist_ok=True)
        run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path / "a.txt"), "--lines", "-o",
                              str(out), "-q", "--vocab-size", "260"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr
        assert f"cannot write the dataset to {out}: File too large; nothing was written" in run.stderr
        assert "Traceback" not in run.stderr
    assert not (tmp_path / "new").exists() and list((tmp_path / "existing").iterdir()) == []


def test_a_line_megabytes_long_without_a_space_is_cut_and_said_so_and_decodes_back(tmp_path):
    from trainer.prepare import PIECE_CHARS

    rng = random.Random(0)
    run = "".join(rng.choice("abcdefgh") for _ in range(3 * PIECE_CHARS + 5))
    texts = ["a short line", "words " * 30_000 + run, "the end"]
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n")
    result = prepare([tmp_path / "a.txt", "--lines", "-o", tmp_path / "ds", "--vocab-size", "300"])
    assert result.exit_code == 0, result.output
    assert f"note: 3 run(s) of {PIECE_CHARS:,} characters without a space or line break were cut" in result.output
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert [tokenizer.decode(d.tolist()) for d in read_documents(tmp_path / "ds", manifest)] == texts


def unigram_entropy(docs, eod_id) -> float:
    """Entropy (nats) of the token frequencies of the packed stream: every document's tokens and its end token."""
    counts = np.bincount(np.concatenate([np.append(d, eod_id) for d in docs]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_a_prepared_corpus_trains_below_its_unigram_entropy_and_the_evaluation_is_reported(trained_on_prepared):
    ds, out = trained_on_prepared.dataset, trained_on_prepared.output_dir
    manifest = json.loads((ds / "manifest.json").read_text())
    floor = unigram_entropy(read_documents(ds, manifest), manifest["eod_id"])
    # A manifest that the model's vocabulary cannot hold: exit 2, before anything is built.
    refused = CliRunner().invoke(train_command, [*trained_on_prepared.records_args, "--steps", "1"])
    assert refused.exit_code == 2
    assert "vocabulary of 320 tokens, more than model.vocab_size=256" in refused.output

    assert len(list((out / "profile").rglob("*.xplane.pb"))) == 1  # train.profile_steps: one trace
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [50, 100, 150]
    assert evals[0]["eval_loss"] > evals[-1]["eval_loss"]
    assert evals[-1]["eval_loss"] < floor - 0.5, (evals[-1]["eval_loss"], floor)
    assert evals[-1]["eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]), rel=1e-6)
    assert 0 <= evals[-1]["eval_drop_fraction"] <= 1
    status = json.loads((out / "status.json").read_text())
    assert (status["eval_step"], status["eval_loss"]) == (150, pytest.approx(evals[-1]["eval_loss"], rel=1e-6))
    # TensorBoard's own reader: one learning/loss point per logged step, equal to metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = events.Scalars("learning/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in rows], atol=1e-6, rtol=0)
    np.testing.assert_allclose([e.value for e in events.Scalars("eval/loss")], [r["eval_loss"] for r in evals],
                               atol=1e-6, rtol=0)
    assert {"perf/tokens_per_sec", "perf/step_time_seconds", "learning/grad_norm", "moe/load_max_over_mean",
            "eval/perplexity"} <= set(events.Tags()["scalars"])
    # each MoE layer's balance under its own tag, equal to its metrics.jsonl key
    layers = sorted({key.split(".")[1] for key in rows[-1] if key.startswith("moe.") and key.count(".") == 2})
    assert layers, rows[-1]
    for layer in layers:
        points = events.Scalars(f"moe/layer{layer}/load_max_over_mean")
        np.testing.assert_allclose([e.value for e in points], [r[f"moe.{layer}.load_max_over_mean"] for r in rows],
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_that_lands_in_a_garbage_collection_still_stops_the_prepare(tmp_path, monkeypatch, signum, code):
    """The handler runs inside a gc callback: an exception raised there would be 'ignored' and the prepare
    would write its dataset and exit 0; the latch (trainer/signals.py) keeps the signal for its next document."""
    import gc
    import threading

    from trainer import prepare as module

    (tmp_path / "a.txt").write_text("".join(f"line {i}\n" for i in range(50)))

    def in_gc(phase, info):
        if phase == "start" and threading.current_thread() is threading.main_thread():
            gc.callbacks.remove(in_gc)
            os.kill(os.getpid(), signum)
            for _ in range(10_000):  # bytecodes: the handler runs here, inside the collection
                pass

    trained = module.train_bpe

    def collecting(*a):
        gc.callbacks.append(in_gc)
        gc.collect()
        return trained(*a)

    monkeypatch.setattr(module, "train_bpe", collecting)
    try:
        with pytest.raises(SystemExit) as exit_:
            module.main([str(tmp_path / "a.txt"), "--lines", "-o", str(tmp_path / "out"), "-q", "--vocab-size", "260"])
    finally:
        if in_gc in gc.callbacks:
            gc.callbacks.remove(in_gc)
    assert exit_.value.code == code and not (tmp_path / "out").exists()


def test_a_models_tokenizer_ends_documents_with_the_eos_the_files_beside_it_name(tmp_path):
    """An imported model's tokenizer.json with no '<|endoftext|>': its tokenizer_config.json's eos_token (an
    object with its content, as the Hub writes it) ends the documents, else its generation_config.json's
    eos_token_id; --eod-token still decides when given."""
    from tokenizers import models, pre_tokenizers

    model = tmp_path / "hf"
    model.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "<s>": 2, "a": 3, "b": 4}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>", "lstrip": False}}))
    (tmp_path / "a.txt").write_text("a b a\nb b\n")

    def eod(out, *extra):
        result = prepare([tmp_path / "a.txt", "--lines", "-o", tmp_path / out, "--tokenizer", model / "tokenizer.json",
                          *extra])
        assert result.exit_code == 0, result.output
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        return manifest["eod_token"], manifest["eod_id"]

    assert eod("ds") == ("</s>", 1)
    assert eod("given", "--eod-token", "<s>") == ("<s>", 2)
    (model / "tokenizer_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert eod("generation") == ("<s>", 2)


def test_an_export_of_a_run_trained_from_scratch_carries_its_datasets_tokenizer(trained_on_prepared, tmp_path):
    """`hf export` of a run trained on prepared text writes its dataset's tokenizer.json with a
    tokenizer_config.json that transformers' AutoTokenizer (so lm-eval's --model hf) loads: the same ids, the
    dataset's end-of-document token as eos (config.json and generation_config.json too), its context."""
    transformers = pytest.importorskip("transformers")
    from trainer.hf.cli import hf_group

    exported = tmp_path / "exported"
    result = CliRunner().invoke(hf_group, ["export", "--checkpoint", str(trained_on_prepared.output_dir), "-o",
                                           str(exported)])
    assert result.exit_code == 0, result.output
    assert "no tokenizer" not in result.output
    manifest = json.loads((trained_on_prepared.dataset / "manifest.json").read_text())
    ours = Tokenizer.from_file(str(trained_on_prepared.dataset / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    text = "The cat sat on the mat, and then it slept."
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text).ids
    assert (theirs.eos_token, theirs.eos_token_id) == (manifest["eod_token"], manifest["eod_id"])
    config = transformers.AutoConfig.from_pretrained(exported)
    assert config.eos_token_id == manifest["eod_id"] and config.max_position_embeddings == 64  # tiny's seq_len
    assert transformers.GenerationConfig.from_pretrained(exported).eos_token_id == manifest["eod_id"]
