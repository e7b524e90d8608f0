"""Prefix caching: a prompt's cached prefix is copied into its slot and the prefill goes on after it; outputs
equal those without the cache; the pool never holds more than its bound, evicting the least recently used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import sharding
from trainer.config import load_config
from trainer.serve.engine import Engine, Request, SamplingParams
from trainer.serve.kvcache import KVCache
from trainer.serve.prefix import BLOCK, PrefixCache
from trainer.serve.weights import build_serving_model, init_weights

pytestmark = pytest.mark.compile_bound


def test_cached_prefixes_give_the_outputs_of_a_prefill_from_scratch():
    cfg = load_config("tiny", ["model.num_kv_heads=2"])
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    weights = init_weights(model)
    rng = np.random.RandomState(3)
    vocab = cfg.model.vocab_size
    # 4 shared prefixes (one shorter than a block, others of whole and broken blocks), 8 suffixes each.
    prefixes = [rng.randint(0, vocab, n).tolist() for n in (9, 40, 64, 101)]
    prompts = [p + rng.randint(0, vocab, rng.randint(1, 24)).tolist() for p in prefixes for _ in range(8)]
    prompts[5] = list(prefixes[0])  # a prompt that is all prefix

    def outputs(engine):
        requests = [engine.submit(Request(p, SamplingParams(max_tokens=8))) for p in prompts]
        engine.run()
        return requests

    cached_engine = Engine(model, weights, slots=8, max_len=288, chunk=16, prefix_cache=1024)
    cached_engine.warm_up()
    prefix, cached_engine.prefix = cached_engine.prefix, None  # the same programs without the cache first
    plain = outputs(cached_engine)
    cached_engine.prefix = prefix
    cached = outputs(cached_engine)
    assert [r.output for r in cached] == [r.output for r in plain]  # 32/32 greedy equal
    # The copies are not the steps: those compiled once a span of the cache they read.
    runner = cached_engine.runner
    assert cached_engine.compilations() == len(runner.programs) <= runner.programs_bound()
    hits = [r.cached_tokens for r in cached]
    assert all(h % BLOCK == 0 and h < len(r.prompt) for h, r in zip(hits, cached, strict=True))
    # The first request of each prefix finds nothing of it; the rest find its whole blocks.
    owners = [p for p in prefixes for _ in range(8)]
    assert sum(h >= (len(p) // BLOCK) * BLOCK for h, p in zip(hits, owners, strict=True)) >= 28
    assert [r.prefix_queried for r in cached] == [len(p) for p in prompts]


def test_the_pool_stays_within_its_bound_and_every_hit_is_the_prefix_stored():
    """200 requests of random prefixes over a pool of 6 blocks: what a load copies into a slot is what the
    same tokens' store took from one, never another prompt's."""
    layers, slots, max_len, heads, size = 2, 3, 80, 2, 4
    cache = KVCache.empty(layers, slots, max_len, heads, size, jnp.int8)
    bound = 6 * BLOCK
    prefix = PrefixCache(cache, bound)
    block_bytes = PrefixCache.block_bytes(KVCache.nbytes(layers, slots, max_len, heads, size, jnp.int8), slots,
                                          max_len)
    assert prefix.nbytes == prefix.capacity * block_bytes <= bound // BLOCK * block_bytes

    def written(prompt):  # what a prefill would leave in a slot: a function of the tokens up to each position
        codes = np.cumsum(np.asarray(prompt, np.int64) * 7919) % 251 - 125
        values = np.broadcast_to(codes[None, :, None, None], (layers, len(prompt), heads, size)).astype(np.int8)
        return values, np.broadcast_to(codes[None, :, None], (layers, len(prompt), heads)).astype(np.float32)

    rng = np.random.RandomState(0)
    stems = [rng.randint(0, 50, 3 * BLOCK).tolist() for _ in range(5)]
    hit_count = 0
    for i in range(200):
        stem = stems[rng.randint(len(stems))][:rng.randint(0, 3 * BLOCK + 1)]
        prompt = stem + rng.randint(0, 50, rng.randint(1, 20)).tolist()
        slot = i % slots
        cache, hit = prefix.load(cache, prompt, slot)
        assert hit % BLOCK == 0 and hit < len(prompt)
        values, scales = written(prompt)
        if hit:
            hit_count += 1
            np.testing.assert_array_equal(np.asarray(cache.k[:, slot, :hit]), values[:, :hit])
            np.testing.assert_array_equal(np.asarray(cache.v_scale[:, slot, :hit]), scales[:, :hit])
        host = [np.array(a) for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)]
        for array, value in zip(host, (values, values, scales, scales), strict=True):  # the prefill writes the rest
            array[:, slot, :len(prompt)] = value
        cache = KVCache(*map(jnp.asarray, host))
        prefix.store(cache, prompt, slot)
        assert len(prefix.blocks) <= prefix.capacity
        assert sorted([*prefix.blocks.values(), *prefix.unused]) == list(range(prefix.capacity))
        assert prefix.nbytes <= bound // BLOCK * block_bytes
    assert 20 < hit_count < 200  # some prefixes were found, some had been evicted


def test_a_block_outlives_the_blocks_that_extend_it():
    cache = KVCache.empty(1, 1, 64, 1, 2, jnp.float32)
    prefix = PrefixCache(cache, 3 * BLOCK)
    a = list(range(3 * BLOCK))
    prefix.store(cache, a, 0)
    prefix.store(cache, [99] * BLOCK, 0)  # full: the end of a's chain makes room
    assert prefix.load(cache, a + [1], 0)[1] == 2 * BLOCK
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache(cache, BLOCK - 1)
