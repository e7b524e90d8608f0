"""Deterministic, resumable token sources, sharded per host; `open_data` picks the reader for a config.

Every row of every batch is a pure function of (seed, batch index, row), so the iterator's whole position
is one integer (saved in checkpoints), a resumed run sees the same next batch, and each host makes only
its own rows (`jax.process_index`). Rows hold seq_len + 1 tokens: inputs are [:-1], targets [1:].
Token arrays and prepared datasets (ArrayRecord) are read through Grain instead: trainer/datasets.py.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from trainer.config import NO_DATA, Config, DataConfig
from trainer.datasets import open_datasets
from trainer.manifest import DataError, regular_file


class Source(Protocol):
    fingerprint: str
    entropy_floor: float | None

    def rows(self, index: int, row_ids: Sequence[int]) -> np.ndarray:
        """Rows `row_ids` of batch `index`: int32 [len(row_ids), seq_len + 1]."""
        ...


def _row_rng(seed: int, index: int, row: int) -> np.random.Generator:
    return np.random.default_rng((seed, index, row))


class MarkovSource:
    """A first-order Markov chain over `vocab` states with a known entropy rate (nats per token).

    Each state has `branching` successors (one of them s+1, which makes the chain irreducible) with
    Dirichlet weights. Sequences start from the stationary distribution, so every target token's
    conditional entropy given its past is the entropy rate: the best achievable loss, `entropy_floor`.
    """

    def __init__(self, vocab: int, branching: int, concentration: float, seq_len: int, seed: int):
        rng = np.random.default_rng((seed, 0x4D41524B))
        succ_VxK = np.zeros((vocab, branching), np.int64)
        prob_VxK = np.zeros((vocab, branching))
        for s in range(vocab):
            others = np.setdiff1d(np.arange(vocab), [(s + 1) % vocab])
            succ_VxK[s] = np.concatenate([[(s + 1) % vocab], rng.choice(others, branching - 1, replace=False)])
            prob_VxK[s] = rng.dirichlet(np.full(branching, concentration))
        self.succ_VxK, self.cum_VxK = succ_VxK, np.cumsum(prob_VxK, axis=1)
        self.cum_VxK[:, -1] = 1.0
        transition_VxV = np.zeros((vocab, vocab))
        np.add.at(transition_VxV, (np.repeat(np.arange(vocab), branching), succ_VxK.ravel()), prob_VxK.ravel())
        self.stationary_V = stationary_distribution(transition_VxV)
        self.cum_stationary_V = np.cumsum(self.stationary_V)
        self.cum_stationary_V[-1] = 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            h_V = -np.sum(np.where(prob_VxK > 0, prob_VxK * np.log(prob_VxK), 0.0), axis=1)
        self.entropy_floor = float(self.stationary_V @ h_V)
        self.seq_len, self.seed = seq_len, seed
        self.fingerprint = f"markov:v{vocab}:k{branching}:c{concentration}:s{seed}:l{seq_len}"

    def rows(self, index: int, row_ids: Sequence[int]) -> np.ndarray:
        u_RxT = np.stack([_row_rng(self.seed, index, r).random(self.seq_len + 1) for r in row_ids])
        out_RxT = np.empty(u_RxT.shape, np.int32)
        state_R = np.searchsorted(self.cum_stationary_V, u_RxT[:, 0], side="right")
        out_RxT[:, 0] = state_R
        for t in range(1, u_RxT.shape[1]):
            pick_R = np.sum(u_RxT[:, t, None] >= self.cum_VxK[state_R], axis=1)
            state_R = self.succ_VxK[state_R, np.minimum(pick_R, self.succ_VxK.shape[1] - 1)]
            out_RxT[:, t] = state_R
        return out_RxT


def stationary_distribution(transition_VxV: np.ndarray) -> np.ndarray:
    """pi with pi P = pi and sum(pi) = 1 (the chain must be irreducible)."""
    v = transition_VxV.shape[0]
    a = np.vstack([transition_VxV.T - np.eye(v), np.ones((1, v))])
    b = np.concatenate([np.zeros(v), [1.0]])
    pi, *_ = np.linalg.lstsq(a, b, rcond=None)
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


class WindowSource:
    """Random windows of seq_len + 1 tokens from one long token array (bytes of text, or token ids)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, fingerprint: str):
        if tokens.shape[0] < seq_len + 2:
            raise DataError(f"the data has {tokens.shape[0]} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.fingerprint = fingerprint
        self.entropy_floor = None

    def rows(self, index: int, row_ids: Sequence[int]) -> np.ndarray:
        high = self.tokens.shape[0] - self.seq_len - 1
        starts = [int(_row_rng(self.seed, index, r).integers(0, high + 1)) for r in row_ids]
        return np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], np.int32) for s in starts])


def text_files(pattern: str, key: str) -> list[str]:
    """The files a glob matches, directories skipped; a FIFO or device among them (which would block, or
    never end) is refused by name before anything is read."""
    files = [f for f in sorted(glob.glob(pattern, recursive=True)) if not os.path.isdir(f)]
    for f in files:
        regular_file(f, key)
    if not files:
        raise DataError(f"{key} '{pattern}' matches no files")
    return files


def text_source(cfg: DataConfig, seed: int, key: str = "data.path") -> WindowSource:
    files = text_files(cfg.path, key)
    try:
        data = b"".join(open(f, "rb").read() for f in files)
    except OSError as e:
        raise DataError(f"{key}: cannot read {e.filename}: {e.strerror}") from None
    tokens = np.frombuffer(data, np.uint8)
    return WindowSource(tokens, cfg.seq_len, seed, f"text:{cfg.path}:{len(files)}:{tokens.shape[0]}")


def make_source(cfg: Config, seed: int) -> Source:
    d = cfg.data
    if d.source == "synthetic":
        return MarkovSource(d.synthetic_vocab, d.synthetic_branching, d.synthetic_concentration, d.seq_len, seed)
    if d.source == "text":
        return text_source(d, seed)
    if d.source == "none":
        raise DataError(NO_DATA)
    raise ValueError(f"data.source={d.source} is read through trainer.datasets (open_data)")


EVAL_OFFSET = 1 << 40  # synthetic evaluation batches: indices that training never reaches


def open_data(cfg: Config, seed: int, *, process_index: int = 0, process_count: int = 1,
              with_eval: bool = False):
    """(this host's training iterator, a factory of fresh evaluation iterators or None) for the config.

    Token arrays and prepared datasets go through Grain (trainer.datasets); the synthetic source and
    byte-level text are generated here. Synthetic data is evaluated on batches training never sees;
    text on data.eval_path's files.
    """
    d = cfg.data
    if d.source in ("tokens", "records"):
        return open_datasets(cfg, seed, process_index=process_index, process_count=process_count,
                             with_eval=with_eval)
    source = make_source(cfg, seed)
    hosts = {"process_index": process_index, "process_count": process_count}
    train = DataIterator(source, d.global_batch_size, cfg.model.vocab_size, **hosts)
    if not with_eval:
        return train, None
    if d.source == "synthetic":
        return train, lambda: DataIterator(source, d.global_batch_size, cfg.model.vocab_size,
                                           position=EVAL_OFFSET, **hosts)
    if not d.eval_path:
        return train, None
    eval_source = text_source(d.model_copy(update={"path": d.eval_path}), seed + 1, "data.eval_path")
    return train, lambda: DataIterator(eval_source, d.global_batch_size, cfg.model.vocab_size, **hosts)


class DataIterator:
    """Yields this host's rows of consecutive global batches; `position` is the next batch index."""

    def __init__(self, source: Source, global_batch: int, vocab_size: int, *, process_index: int = 0,
                 process_count: int = 1, position: int = 0):
        self.start = position
        if global_batch % process_count:
            raise DataError(f"data.global_batch_size ({global_batch}) must be divisible by the number of "
                            f"hosts ({process_count})")
        per_host = global_batch // process_count
        self.row_ids = list(range(process_index * per_host, (process_index + 1) * per_host))
        self.source, self.vocab_size, self.position = source, vocab_size, position
        self.fingerprint, self.entropy_floor = source.fingerprint, source.entropy_floor

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        rows_BxT = self.source.rows(self.position, self.row_ids)
        if rows_BxT.size and (rows_BxT.max() >= self.vocab_size or rows_BxT.min() < 0):
            raise DataError(f"token id {int(rows_BxT.max())} is outside the model's vocabulary "
                            f"(model.vocab_size={self.vocab_size})")
        self.position += 1
        return rows_BxT

    def state(self) -> dict:
        return {"position": self.position - self.start, "source": self.source.fingerprint}

    def restore(self, state: dict) -> None:
        self.position = self.start + int(state["position"])
