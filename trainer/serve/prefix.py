"""Prefix caching: prompts that share a prefix (a system prompt, few-shot examples, a chat's earlier turns) reuse
its keys and values instead of prefilling it again.

A prompt is cut into blocks of BLOCK token ids, each block keyed by a hash chain (sha256 of the previous block's key
and this block's ids), so two prompts' keys for block i are equal exactly when their first i + 1 blocks are. The
cached blocks' keys and values live on the device in a pool shaped like the slot cache with (slots, max_len) turned
into (blocks, BLOCK): for each of the cache's arrays [layers, slots, max_len, ...] an array [layers, capacity,
BLOCK, ...]. Any pytree of such arrays works (the KV cache with or without its int8 scales, a latent cache). The
pool holds `capacity` blocks at most, allocated once; when it is full the least recently used block makes room.
A lookup touches a prompt's blocks from the last to the first, so a block is always more recent than the blocks
that extend it and eviction takes the ends of chains first.

At admission the longest cached prefix is copied into the request's slot (one jitted program of fixed shape: as
many blocks as a slot holds, the padding's writes dropped), and the chunked prefill goes on from the first position
not cached. The prompt's last token is always prefilled (its logits draw the first token), and a request that
scores its prompt (echo with logprobs) prefills it all. Once a prompt is in its slot, its whole blocks not cached
yet are copied into the pool. Copies, not pages shared between slots: the slot cache stays what the runner and
attention know, and a cached block holds what the prefill wrote, so outputs are those of a prefill from scratch.
"""

from __future__ import annotations

import collections
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from trainer.arith.kv import PREFIX_BLOCK

BLOCK = PREFIX_BLOCK  # tokens a block


def unsupported(model_config) -> str | None:
    """Why prefix caching cannot serve this model (trainer.config.ModelConfig), or None where it can.

    A model with sliding-window layers keeps only their window's positions, in a ring (trainer/serve/ringcache.py).
    A cached prefix of P tokens would have to bring the sliding layers' keys and values of positions P - window
    to P, but once a prompt runs a window past P its ring holds later positions: the blocks a later prompt
    shares (a system prompt) are gone from the ring by the time the prompt is stored. Rather than keep full-length
    sliding caches for it, the engine serves such a model without a prefix cache."""
    if any(model_config.window(i) for i in range(model_config.num_layers)):
        return (f"prefix caching is off: the model's sliding-window layers keep only their last "
                f"{model_config.sliding_window} positions, not the prefix's keys and values it would reuse")
    return None


def _load(cache, pool, slot, ids_N, positions_NxB):
    """The cache with pool blocks ids_N written at positions_NxB of `slot` (positions past max_len dropped)."""
    def one(c, p):
        rows = p[:, ids_N].reshape(p.shape[0], -1, *p.shape[3:])
        return c.at[:, slot, positions_NxB.reshape(-1)].set(rows, mode="drop")

    return jax.tree.map(one, cache, pool)


def _save(pool, cache, slot, ids_N, positions_NxB):
    """The pool with `slot`'s positions_NxB written into blocks ids_N (ids past the pool dropped)."""
    def one(p, c):
        rows = c[:, slot, positions_NxB.reshape(-1)]
        return p.at[:, ids_N].set(rows.reshape(p.shape[0], *positions_NxB.shape, *p.shape[3:]), mode="drop")

    return jax.tree.map(one, pool, cache)


class PrefixCache:
    def __init__(self, cache, capacity_tokens: int, block: int = BLOCK):
        """A pool of capacity_tokens // block blocks for `cache`, a pytree of [layers, slots, max_len, ...]
        arrays (its shardings are the pool's: the axes after max_len split alike)."""
        if capacity_tokens < block:
            raise ValueError(f"the prefix cache must hold at least one block of {block} tokens, got {capacity_tokens}")
        self.block, self.capacity = block, capacity_tokens // block
        self.max_len = jax.tree.leaves(cache)[0].shape[2]
        self.per_copy = self.max_len // block  # the whole blocks a slot holds: every copy's fixed shape
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], self.capacity, block, *a.shape[3:]),
                                                             a.dtype), cache)
        shardings = jax.tree.map(lambda a: a.sharding, cache)
        self.pool = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                            out_shardings=shardings)()
        self._load = jax.jit(_load, donate_argnums=(0,), out_shardings=shardings)
        self._save = jax.jit(_save, donate_argnums=(0,), out_shardings=shardings)
        self.blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> pool block, LRU first
        self.unused = list(range(self.capacity))

    @property
    def nbytes(self) -> int:
        """The pool's device bytes (allocated once: the bound on cached blocks' memory)."""
        return sum(a.nbytes for a in jax.tree.leaves(self.pool))

    @staticmethod
    def block_bytes(cache_nbytes: int, slots: int, max_len: int, block: int = BLOCK) -> int:
        """Bytes of one cached block of a cache of `cache_nbytes` over slots x max_len positions."""
        return cache_nbytes // (slots * max_len) * block

    def _chain(self, prompt: list[int], blocks: int) -> list[bytes]:
        key, keys = b"", []
        for i in range(blocks):
            key = hashlib.sha256(key + np.asarray(prompt[i * self.block:(i + 1) * self.block], np.int32).tobytes())
            key = key.digest()
            keys.append(key)
        return keys

    def _plan(self, ids: list[int], blocks: list[int], pad_id: int, pad_position: int):
        """The copies' fixed-shape inputs: pool ids [per_copy] and slot positions [per_copy, block]."""
        ids_N = np.full(self.per_copy, pad_id, np.int32)
        ids_N[:len(ids)] = ids
        positions_NxB = np.full((self.per_copy, self.block), pad_position, np.int32)
        positions_NxB[:len(blocks)] = np.asarray(blocks, np.int32)[:, None] * self.block + np.arange(self.block)
        return ids_N, positions_NxB

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block last: the most recent
            self.blocks.move_to_end(key)

    def warm_up(self, cache):
        """Compiles both copies (all padding: nothing is written); returns the cache."""
        ids_N, positions_NxB = self._plan([], [], self.capacity, self.max_len)
        self.pool = self._save(self.pool, cache, np.int32(0), ids_N, positions_NxB)
        return self._load(cache, self.pool, np.int32(0), ids_N, positions_NxB)

    def load(self, cache, prompt: list[int], slot: int):
        """(the cache with the prompt's longest cached prefix in `slot`'s first positions, that prefix's length in
        tokens: a multiple of the block, short of the prompt's last token)."""
        hits = []
        for key in self._chain(prompt, (len(prompt) - 1) // self.block):
            if key not in self.blocks:
                break
            hits.append(key)
        if not hits:
            return cache, 0
        self._touch(hits)
        ids_N, positions_NxB = self._plan([self.blocks[k] for k in hits], list(range(len(hits))), 0, self.max_len)
        cache = self._load(cache, self.pool, np.int32(slot), ids_N, positions_NxB)
        return cache, len(hits) * self.block

    def store(self, cache, prompt: list[int], slot: int) -> None:
        """Copies the whole blocks of the prompt in `slot` that are not cached yet into the pool, evicting the least
        recently used blocks for room (never this prompt's own)."""
        keys = self._chain(prompt, min(len(prompt), self.max_len) // self.block)
        held = [k for k in keys if k in self.blocks]
        self._touch(held)
        room = self.capacity - len(held)
        new = [(i, k) for i, k in enumerate(keys) if k not in self.blocks][:room]
        if not new:
            return
        ids = []
        for _ in new:
            if not self.unused:
                self.unused.append(self.blocks.popitem(last=False)[1])
            ids.append(self.unused.pop())
        for (_, key), at in zip(new, ids, strict=True):
            self.blocks[key] = at
        self._touch([k for k in keys if k in self.blocks])
        ids_N, positions_NxB = self._plan(ids, [i for i, _ in new], self.capacity, 0)
        self.pool = self._save(self.pool, cache, np.int32(slot), ids_N, positions_NxB)
