"""trainer.prepare: text, JSON lines and Parquet into ArrayRecord shards and a manifest; bad input exits 2;
a prepared corpus trains (eval loss under the tokens' unigram entropy), the evaluation reaches every report,
TensorBoard holds the metrics, and train.profile_steps leaves one trace."""

import json
import math
import random

import numpy as np
import pytest
from array_record.python import array_record_module
from click.testing import CliRunner
from tokenizers import Tokenizer

from trainer.cli import train_command
from trainer.prepare import prepare_command

SUBJECTS = ["the cat", "a dog", "my old friend", "the tall man", "a small bird", "her sister"]
VERBS = ["sat on", "looked at", "ran to", "jumped over", "walked past"]
OBJECTS = ["the mat", "a green tree", "the house", "the river", "a red car"]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(1, 3))) for _ in range(n)]


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
])
def test_bad_input_exits_2_naming_the_file_or_key(tmp_path, case, needle):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    (tmp_path / "a.txt").write_text("some text here\n")
    args = {"missing tokenizer": [tmp_path / "a.txt", "--tokenizer", tmp_path / "none.json"],
            "corrupt tokenizer": [tmp_path / "a.txt", "--tokenizer", tmp_path / "bad.json"],
            "no inputs": [f"{tmp_path}/*.none"],
            "no text key": [tmp_path / "docs.jsonl"],
            "no end token": [tmp_path / "a.txt", "--eod-token", "<eod>", "--vocab-size", "260"]}[case]
    result = prepare([*args, "-o", tmp_path / "out"])
    assert result.exit_code == 2, result.output
    assert needle.format(tmp=tmp_path) in result.output
    assert "Traceback" not in result.output


def unigram_entropy(docs, eod_id) -> float:
    """Entropy (nats) of the token frequencies of the packed stream: every document's tokens and its end token."""
    counts = np.bincount(np.concatenate([np.append(d, eod_id) for d in docs]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_a_prepared_corpus_trains_below_its_unigram_entropy_and_the_evaluation_is_reported(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(4000)))
    assert prepare([tmp_path / "docs.jsonl", "-o", tmp_path / "ds", "--vocab-size", "320"]).exit_code == 0
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    floor = unigram_entropy(read_documents(tmp_path / "ds", manifest), manifest["eod_id"])
    common = ["--config", "tiny", "--devices", "1", "--set", "data.source=records", "--set",
              f"data.path={tmp_path / 'ds'}", "--set", "data.eval_share=0.05"]
    # A manifest that the model's vocabulary cannot hold: exit 2, before anything is built.
    refused = CliRunner().invoke(train_command, [*common, "--steps", "1"])
    assert refused.exit_code == 2
    assert "vocabulary of 320 tokens, more than model.vocab_size=256" in refused.output

    out = tmp_path / "out"
    result = CliRunner().invoke(train_command, [
        *common, "--set", "model.vocab_size=320", "--set", "train.eval_every=50", "--set", "train.eval_batches=2",
        "--set", "train.log_every=10", "--set", "train.profile_steps=[3, 5]", "--steps", "150",
        "--output-dir", str(out), "--metrics", str(tmp_path / "m.jsonl")])
    assert result.exit_code == 0, result.output
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
