"""A sliding-window layer's serving cache (trainer/serve/ringcache.py): each slot holds the window's positions
alone, in a ring; through it a token at a time, prefill chunks longer than the window and a padded last chunk
give the full forward pass's logits, the engine's greedy tokens are the full forward's, the memory plan counts
the smaller cache, and prefix caching is off (with a log line) for such a model."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import sharding
from trainer.config import load_config
from trainer.serve.engine import Engine, Request, SamplingParams
from trainer.serve.kvcache import KVCache
from trainer.serve.latentcache import CacheLayout
from trainer.serve.memory import memory_plan
from trainer.serve.weights import build_serving_model, init_weights

pytestmark = pytest.mark.compile_bound
WINDOW, LENGTH, MAX_LEN = 5, 21, 32  # LENGTH: four windows and more
# `tiny` as GPT-OSS lays its attention out: sliding and full layers alternating, attention sinks.
OVERRIDES = ["model.num_kv_heads=2", "model.num_layers=4", "model.layer_types=[sliding,full,sliding,full]",
             f"model.sliding_window={WINDOW}", "model.attention_sinks=true"]


@pytest.fixture(scope="module")
def windowed():
    """The model, its weights and its full forward pass (one compilation: [3, LENGTH] tokens)."""
    cfg = load_config("tiny", OVERRIDES)
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    return model, init_weights(model), jax.jit(lambda w, t: model.module(w)(t, train=False)[0])


def test_sliding_layers_hold_their_window_alone_and_the_plan_counts_it(windowed, caplog):
    model, weights, _ = windowed
    m = model.cfg.model
    with caplog.at_level(logging.WARNING, logger="trainer.serve"):
        engine = Engine(model, weights, slots=2, max_len=MAX_LEN, chunk=8, prefix_cache=64)
    assert engine.prefix is None and "prefix caching is off" in caplog.text
    cache = engine.cache
    assert cache.ring.k.shape == cache.ring.v.shape == (2, 2, WINDOW, m.kv_heads, m.head_size)  # 2 sliding layers
    assert cache.full.k.shape == cache.full.v.shape == (2, 2, MAX_LEN, m.kv_heads, m.head_size)
    assert cache.ranks == (0, 0, 1, 1)  # layer i's index among the layers of its kind
    for dtype in ("float32", "int8"):
        held = sum(a.nbytes for a in jax.tree.leaves(Engine(model, weights, slots=2, max_len=MAX_LEN, chunk=8,
                                                            kv_dtype=dtype).cache))
        every_position = KVCache.nbytes(m.num_layers, 2, MAX_LEN, m.kv_heads, m.head_size, dtype)
        assert memory_plan(model, 2, MAX_LEN, dtype, None)["kv_cache"] == held
        assert held == every_position * (MAX_LEN + WINDOW) // (2 * MAX_LEN)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_tokens_and_chunks_longer_than_the_window_give_the_full_forward_logits(windowed, dtype):
    """Four tokens one at a time reading a span shorter than the ring, a chunk of 8 (longer than the window),
    a chunk of 8 whose last 3 are padding (never written: they would land on positions still in the window),
    then a token at a time across the rest; slot 1 of 3, the others untouched. An int8 cache within 2% of the
    largest logit (its keys and values rounded, the chunk's own read back as the cache holds them)."""
    model, weights, forward = windowed
    m = model.cfg.model
    # numpy on the host: a jax array's every slice and index would compile a program of its own
    tokens_1xL = np.random.RandomState(0).randint(0, m.vocab_size, (1, LENGTH)).astype(np.int32)
    decode = jax.jit(lambda w, c, t, s, n, span: model.module(w).decode(t, c, s, jnp.asarray([1]), span, n),
                     static_argnums=5)
    layout = CacheLayout.of(m)
    # laid out as the engine lays it out, as the decode returns it: each call after the first runs its program
    cache, pieces = jax.device_put(layout.empty(3, MAX_LEN, dtype), layout.sharding(model.mesh, dtype, MAX_LEN)), []
    for start in range(4):
        logits, cache = decode(weights, cache, tokens_1xL[:, start:start + 1], np.asarray([start], np.int32), None, 4)
        pieces.append(np.asarray(logits)[0])
    for start, real in ((4, 8), (12, 5)):
        chunk = np.zeros((1, 8), np.int32)
        chunk[:, :real] = tokens_1xL[:, start:start + real]
        logits, cache = decode(weights, cache, chunk, np.asarray([start], np.int32), np.asarray([real], np.int32), None)
        pieces.append(np.asarray(logits)[0, :real])
    for start in range(17, LENGTH):
        logits, cache = decode(weights, cache, tokens_1xL[:, start:start + 1], np.asarray([start], np.int32), None,
                               None)
        pieces.append(np.asarray(logits)[0])
    full = np.asarray(forward(weights, np.tile(tokens_1xL, (3, 1))))[0]
    error = float(np.abs(np.concatenate(pieces) - full).max())
    assert error <= (1e-5 if dtype == "float32" else 0.02 * float(np.abs(full).max())), error
    assert not any(np.any(np.asarray(a)[:, [0, 2]]) for a in jax.tree.leaves(cache)), "other slots untouched"


@pytest.mark.parametrize("mixed", [False, True], ids=["chunks-apart", "chunks-with-the-step"])
def test_the_engines_greedy_tokens_are_the_full_forwards(windowed, mixed):
    """Three requests on two slots, prompts prefilled in chunks of 8 (the last padded), then decoded past several
    windows: each token the full forward's argmax after the tokens before it. The first ends early, and while
    the third is prefilled into its slot 0 the decode step runs that slot (at max_len: idle) beside the second's,
    which must write nothing into the ring being prefilled: with the chunk in its own program, and with it
    taken along by the decode step (serve --mixed-prefill)."""
    model, weights, forward = windowed
    engine = Engine(model, weights, slots=2, max_len=MAX_LEN, chunk=8, min_span=MAX_LEN,  # one span
                    mixed_prefill=mixed)
    prompts = np.random.RandomState(1).randint(0, model.cfg.model.vocab_size, (3, 11))
    requests = [engine.submit(Request(p[:n].tolist(), SamplingParams(max_tokens=new, temperature=0.0)))
                for p, n, new in zip(prompts, (11, 9, 10), (3, LENGTH - 9, LENGTH - 10), strict=True)]
    engine.run()
    assert [r.slot for r in requests] == [None] * 3 and engine.runner.calls["decode/32/2"]
    assert bool(engine.runner.calls["mixed/32/32"]) == mixed
    tokens_3xL = np.zeros((3, LENGTH), np.int32)  # zeros after the first's: later positions change no earlier one
    for row, r in enumerate(requests):
        tokens_3xL[row, :len(r.prompt) + len(r.output)] = r.prompt + r.output
    greedy_3xL = np.asarray(forward(weights, tokens_3xL)).argmax(-1)
    for row, r in enumerate(requests):
        assert r.output == greedy_3xL[row, len(r.prompt) - 1:len(r.prompt) + len(r.output) - 1].tolist()
