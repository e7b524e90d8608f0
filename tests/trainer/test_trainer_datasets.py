"""Grain datasets: per-host shards are disjoint and cover every record, packing keeps every document, a
resumed iterator yields exactly the next batches from a small state, ranged reads, start-up errors."""

import json

import fsspec
import numpy as np
import pytest
from array_record.python import array_record_module

from trainer.config import load_config
from trainer.data import DataError, open_data
from trainer.datasets import GrainIterator, TokenRows, document_source, host_records, row_pipeline

EOD = 0


def write_dataset(directory, docs, vocab, shards=2):
    """A prepared dataset written directly: `docs` (lists of token ids) into `shards` ArrayRecord files."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for k in range(shards):
        name = f"train-{k:05d}.array_record"
        writer = array_record_module.ArrayRecordWriter(str(directory / name), "group_size:1")
        part = docs[k::shards]
        for doc in part:
            writer.write(np.asarray(doc, np.uint16).tobytes())
        writer.close()
        entries.append({"file": name, "documents": len(part), "tokens": sum(map(len, part))})
    manifest = {"format": "moe-tpu-dataset", "version": 1, "vocab_size": vocab, "eod_id": EOD,
                "token_dtype": "uint16", "documents": len(docs), "tokens": sum(map(len, docs)), "shards": entries}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def records_config(path, vocab, *extra):
    return load_config("tiny", ["data.source=records", f"data.path={path}", f"model.vocab_size={vocab}",
                                "data.seq_len=16", "data.global_batch_size=8", *extra])


def test_four_hosts_read_disjoint_rows_that_together_are_every_row(tmp_path):
    seq_len, n = 8, 8192
    path = tmp_path / "tokens.bin"
    np.arange(n * seq_len + 1, dtype=np.uint32).tofile(path)
    cfg = load_config("tiny", ["data.source=tokens", f"data.path={path}", "data.token_dtype=uint32",
                               f"data.seq_len={seq_len}", "data.global_batch_size=64",
                               f"model.vocab_size={n * seq_len + 1}"])
    seen = []
    for host in range(4):
        data, _ = open_data(cfg, seed=5, process_index=host, process_count=4)
        rows = np.concatenate([next(data) for _ in range(n // 64)])  # one epoch: 2048 rows per host
        assert all(np.array_equal(r, np.arange(r[0], r[0] + seq_len + 1)) for r in rows[:50])
        seen.append(set((rows[:, 0] // seq_len).tolist()))
        assert len(seen[-1]) == n // 4
    assert set().union(*seen) == set(range(n))
    assert sum(map(len, seen)) == n
    # The shuffle is global and by seed: another seed, another order; the first host's first rows vary.
    again, _ = open_data(cfg, seed=6, process_index=0, process_count=4)
    first, _ = open_data(cfg, seed=5, process_index=0, process_count=4)
    assert not np.array_equal(next(again), next(first))


def test_documents_are_sharded_by_host_and_packed_whole_with_an_end_token(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[i // 49 + 1, i % 49 + 1, *rng.integers(1, 50, rng.integers(0, 30))] for i in range(400)]  # distinct
    ds = write_dataset(tmp_path / "ds", docs, vocab=50)
    import grain

    source = grain.MapDataset.source(document_source([str(p) for p in sorted(ds.glob("*.array_record"))]))
    hosts = [host_records(source, seed=1, process_index=h, process_count=4) for h in range(4)]
    epoch = [[bytes(hosts[h][i]) for i in range(100)] for h in range(4)]
    assert sum(len(set(e)) for e in epoch) == 400 == len(set().union(*map(set, epoch)))
    # Host 0's packed rows, joined, are its documents in order, each followed by the end token.
    rows = row_pipeline(hosts[0], documents={"token_dtype": "uint16", "eod_id": EOD}, seq_len=16, per_host=4)
    stream = np.concatenate([b.ravel() for b, _ in zip(rows, range(30), strict=False)])
    expected = np.concatenate([np.append(np.frombuffer(r, np.uint16), EOD) for r in epoch[0]])
    n = min(len(stream), len(expected))
    assert n > 1000 and np.array_equal(stream[:n], expected[:n])


def test_a_resumed_iterator_sees_exactly_the_next_batches_from_a_small_state(tmp_path):
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(1, 300, rng.integers(3, 40))) for _ in range(3000)]
    cfg = records_config(write_dataset(tmp_path / "ds", docs, vocab=300), 300)
    straight, _ = open_data(cfg, seed=0)
    batches = [next(straight) for _ in range(50)]
    stopped, _ = open_data(cfg, seed=0)
    for _ in range(37):
        next(stopped)
    state = json.loads(json.dumps(stopped.state()))  # as the checkpoint keeps it
    assert len(json.dumps(state["hosts"][0]).encode()) < 1024
    # Through a checkpoint (the state rides in the checkpoint's JSON item), the same.
    import jax
    import jax.numpy as jnp

    from trainer.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1, keep=1, async_save=False)
    ckpt.save(37, {"step": jnp.asarray(37, jnp.int32)}, stopped.state(), force=True)
    ckpt.wait()
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, saved = ckpt.restore(37, {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)})
    ckpt.close()
    assert saved == state
    resumed, _ = open_data(cfg, seed=0)
    resumed.restore(saved)
    for expected in batches[37:]:
        assert np.array_equal(next(resumed), expected)
    with pytest.raises(DataError, match="for 1 hosts, this run has 2"):
        open_data(cfg, seed=0, process_index=0, process_count=2)[0].restore(state)


def test_a_held_out_share_never_overlaps_training(tmp_path):
    docs = [[i % 200 + 1, i // 200 + 1] for i in range(2000)]  # every document distinct
    cfg = records_config(write_dataset(tmp_path / "ds", docs, vocab=300, shards=1), 300, "data.eval_share=0.1")
    train, make_eval = open_data(cfg, seed=0, with_eval=True)

    def pairs(rows):
        s = rows.ravel()
        return {(int(a), int(b)) for a, b, e in zip(s, s[1:], s[2:], strict=False) if e == EOD and a and b}

    train_docs = set().union(*(pairs(next(train)) for _ in range(300)))
    evaluation = make_eval()
    eval_docs = set().union(*(pairs(next(evaluation)) for _ in range(30)))
    assert len(eval_docs) > 150 and len(train_docs) > 1500
    assert not train_docs & eval_docs
    # Every evaluation starts over: the same batches each time.
    assert np.array_equal(next(make_eval()), next(make_eval()))


def test_remote_token_arrays_are_read_by_range(tmp_path):
    tokens = (np.arange(5000) % 251).astype(np.uint16)
    fs = fsspec.filesystem("memory")
    with fs.open("/bucket/tokens.npy", "wb") as f:
        np.save(f, tokens)
    reads = []
    original = fs.cat_file

    def counting(path, start=None, end=None, **kw):
        reads.append((start, end))
        return original(path, start=start, end=end, **kw)

    fs.cat_file = counting
    try:
        rows = TokenRows("memory://bucket/tokens.npy", "uint16", 32)
        assert len(rows) == 4999 // 32 and np.array_equal(rows[3], tokens[96:129])
    finally:
        fs.cat_file = original
    assert reads and all(end - start == 33 * 2 for start, end in reads)


@pytest.mark.parametrize("case, message", [
    ("vocab", r"vocabulary of 300 tokens, more than model.vocab_size=256; set --set model.vocab_size=300"),
    ("short", r"holds 10 tokens, fewer than one row of data.seq_len \+ 1 = 17"),
    ("empty", r"train-00001.array_record holds no documents"),
    ("hosts", r"the data has 3 records, fewer than the 4 hosts"),
    ("eval", r"data.eval_path '.*nothing\*' matches"),
    ("tiny", r"holds 12 tokens with its end-of-document tokens, fewer than one row of data.seq_len \+ 1 = 17"),
])
def test_data_that_does_not_fit_is_refused_at_start_up(tmp_path, case, message):
    docs = [[1, 2, 3]] * 3
    if case == "vocab":
        cfg = records_config(write_dataset(tmp_path / "ds", docs, vocab=300), 256)
    elif case == "short":
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
        cfg = load_config("tiny", ["data.source=tokens", f"data.path={tmp_path}/t.bin", "data.seq_len=16"])
    elif case == "empty":
        cfg = records_config(write_dataset(tmp_path / "ds", [[1, 2]], vocab=300, shards=2), 300)
    elif case == "hosts":
        cfg = records_config(write_dataset(tmp_path / "ds", [list(range(1, 9))] * 3, vocab=300, shards=1), 300)
    elif case == "tiny":
        cfg = records_config(write_dataset(tmp_path / "ds", docs, vocab=300, shards=1), 300)
    else:
        cfg = records_config(write_dataset(tmp_path / "ds", docs * 2, vocab=300), 300,
                             f"data.eval_path={tmp_path}/nothing*", "train.eval_every=5")
    with pytest.raises(DataError, match=message):
        open_data(cfg, seed=0, process_count=4 if case == "hosts" else 1, with_eval=True)


def test_token_ids_past_the_vocabulary_name_the_setting():
    it = GrainIterator(iter([np.array([[1, 2, 999]])]), "f", 300)
    with pytest.raises(DataError, match=r"data.path: token id 999 is outside the model's vocabulary"):
        next(it)


def test_a_shard_truncated_to_half_is_a_data_error_naming_it(tmp_path):
    """ArrayRecord's reader refuses it with an empty message: that was 'training failed: IndexError' (exit 1)."""
    import os

    from trainer.manifest import DataError

    ds = write_dataset(tmp_path / "ds", [[1, 2, 3, 4] * 50 for _ in range(200)], vocab=50)
    shard = sorted(ds.glob("*.array_record"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(DataError, match=f"the dataset shard {shard} cannot be read \\(truncated or corrupt\\?\\)"):
        document_source([str(shard)])


@pytest.mark.parametrize("case, message", [
    ("vocab_size below the ids", r"data.path: the dataset shard .*/train-00001.array_record holds token id 250, past "
                                 r"the manifest's 'vocab_size' \(200\)"),
    ("token_dtype uint32 for uint16", r"data.path: the dataset shard .*/train-00000.array_record holds token id "
                                      r"\d+, past the manifest's 'vocab_size' \(300\): its 'vocab_size' or "
                                      r"'token_dtype' \(uint32\) does not match its shards"),
    ("eval ids past the vocabulary", r"data.eval_path: token id 999 is outside the model's vocabulary"),
    ("eval a FIFO", r"data.eval_path '.*/eval.bin' is a FIFO, not a file"),
])
def test_a_manifest_that_lies_and_eval_data_the_model_cannot_read_are_named_at_start_up(tmp_path, case, message):
    """A hand-edited manifest is named by its key and the shard that shows the lie (the first record of every
    shard is read at start-up; every record when it is read); the evaluation batches are read at start-up, so
    that one the model cannot take stops the run before its first step, not at its first evaluation."""
    import os

    even = [[1, 2, 3, 4, 5, 6]] * 8  # whole uint32 tokens too: only their values show the lie
    if case.startswith("vocab_size"):
        write_dataset(tmp_path / "ds", [[1, 2, 3, 4], [250, 1, 2, 3]] + even, 300)  # shard 1 opens with 250
        manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
        (tmp_path / "ds" / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 200}))
        cfg = records_config(tmp_path / "ds", 300)
    elif case.startswith("token_dtype"):
        write_dataset(tmp_path / "ds", even, 300)
        manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
        (tmp_path / "ds" / "manifest.json").write_text(json.dumps({**manifest, "token_dtype": "uint32"}))
        cfg = records_config(tmp_path / "ds", 300)
    else:
        np.arange(1, 2000, dtype=np.uint16).__mod__(250).astype(np.uint16).tofile(tmp_path / "train.bin")
        if case == "eval a FIFO":
            os.mkfifo(tmp_path / "eval.bin")
        else:
            np.full(2000, 999, np.uint16).tofile(tmp_path / "eval.bin")
        cfg = load_config("tiny", ["data.source=tokens", f"data.path={tmp_path}/train.bin", "data.seq_len=16",
                                   f"data.eval_path={tmp_path}/eval.bin", "train.eval_every=5"])
    with pytest.raises(DataError, match=message):
        open_data(cfg, seed=0, with_eval=True)
