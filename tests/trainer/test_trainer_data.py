"""Token sources: a Markov source with a known entropy floor, text bytes, token arrays; determinism."""

import numpy as np
import pytest

from trainer.config import load_config
from trainer.data import DataError, DataIterator, MarkovSource, make_source, open_data


def empirical_conditional_entropy(rows: np.ndarray, vocab: int) -> float:
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (rows[:, :-1].ravel(), rows[:, 1:].ravel()), 1)
    p = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    return float(counts.sum(1) / counts.sum() @ h)


def test_markov_floor_matches_the_samples():
    src = MarkovSource(vocab=16, branching=3, concentration=1.0, seq_len=128, seed=3)
    rows = src.rows(0, range(400))
    assert rows.shape == (400, 129) and rows.dtype == np.int32 and rows.max() < 16
    assert 0 < src.entropy_floor < np.log(3)
    assert empirical_conditional_entropy(rows, 16) == pytest.approx(src.entropy_floor, abs=0.02)
    # Sequences start from the stationary distribution.
    first = np.bincount(src.rows(1, range(4000))[:, 0], minlength=16) / 4000
    assert np.abs(first - src.stationary_V).max() < 0.03


def test_batches_are_pure_functions_of_position_and_rows():
    src = make_source(load_config("tiny"), seed=0)
    a = DataIterator(src, 8, 256)
    first, second = next(a), next(a)
    assert not np.array_equal(first, second)
    b = DataIterator(src, 8, 256)
    b.restore(a.state())
    assert np.array_equal(next(b), next(a))
    # Hosts make disjoint row slices of the same global batch.
    hosts = [next(DataIterator(src, 8, 256, process_index=i, process_count=2)) for i in range(2)]
    assert np.array_equal(np.concatenate(hosts), first)
    with pytest.raises(DataError, match="divisible"):
        DataIterator(src, 7, 256, process_count=2)


def test_text_source_reads_bytes(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello world " * 20)
    (tmp_path / "b.txt").write_bytes(bytes(range(200, 256)) * 3)
    cfg = load_config("tiny", ["data.source=text", f"data.path={tmp_path}/*.txt", "data.seq_len=16"])
    src = make_source(cfg, seed=1)
    rows = next(DataIterator(src, 4, 256))
    assert rows.shape == (4, 17) and src.entropy_floor is None
    data = b"hello world " * 20 + bytes(range(200, 256)) * 3
    for row in rows:
        assert bytes(row.astype(np.uint8)) in data
    with pytest.raises(DataError, match="matches no files"):
        make_source(load_config("tiny", ["data.source=text", f"data.path={tmp_path}/*.none"]), seed=0)


@pytest.mark.parametrize("suffix, dtype", [(".npy", "uint32"), (".bin", "uint16"), (".bin", "uint32")])
def test_token_arrays(tmp_path, suffix, dtype):
    tokens = np.arange(1000, dtype=dtype) % 300
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    cfg = load_config("tiny", ["data.source=tokens", f"data.path={path}", f"data.token_dtype={dtype}",
                               "model.vocab_size=300", "data.global_batch_size=4"])
    rows = next(open_data(cfg, seed=0)[0])
    assert rows.shape == (4, 65)
    assert all(np.array_equal(np.diff(r) % 300, np.ones(64)) for r in rows)  # contiguous windows
    small = load_config("tiny", ["data.source=tokens", f"data.path={path}", f"data.token_dtype={dtype}",
                                 "data.global_batch_size=4"])
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        next(open_data(small, seed=0)[0])
