"""The serving forward pass and engine: decoding through the key/value cache computes what the full
forward pass does; concurrent requests get what they get alone; the two steps compile once."""

import collections
import dataclasses
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import sharding
from trainer.config import load_config
from trainer.serve.engine import Engine, Request, RequestError, SamplingParams
from trainer.serve.kvcache import KVCache
from trainer.serve.latentcache import CacheLayout
from trainer.serve.memory import memory_plan
from trainer.serve.spans import FIRST_PROGRAMS
from trainer.serve.weights import build_serving_model, init_weights

pytestmark = pytest.mark.compile_bound  # small programs, each compiled once: XLA's optimisations cost more


def serving(name, devices=1, expert=1, overrides=()):
    cfg = load_config(name, list(overrides))
    mesh = sharding.make_mesh({"data": devices // expert, "expert": expert}, jax.devices()[:devices])
    model = build_serving_model(cfg, mesh)
    return model, init_weights(model)


LENGTH = 21  # tokens of the full forward passes compared with (one compilation each model)


@pytest.fixture(scope="module")
def tiny():
    """`tiny` with grouped kv heads, its weights and its full forward pass over LENGTH tokens."""
    model, weights = serving("tiny", overrides=["model.num_kv_heads=2"])
    return model, weights, jax.jit(lambda w, t: model.module(w)(t, train=False)[0])


# deepseek-tiny's latent attention with YaRN over an original length the LENGTH tokens pass (the rotary
# frequencies, the rotary values and the softmax scale all scaled: positions matter to the cache).
YARN = "model.mla.yarn={factor: 4, original_max_position_embeddings: 8, mscale: 1.0, mscale_all_dim: 0.8}"


@pytest.fixture(scope="module")
def latent():
    """A latent-attention model, its weights, its full forward pass and its decode through a cache."""
    model, weights = serving("deepseek-tiny", overrides=[YARN])
    return (model, weights, jax.jit(lambda w, t: model.module(w)(t, train=False)[0]),
            jax.jit(lambda w, c, t, s, r: model.module(w).decode(t, c, s, r)))


@pytest.fixture(scope="module")
def latent_attention(latent):
    """The latent model's first attention layer, with its slice of the stacked weights (sliced once, op by op)."""
    model, weights, *_ = latent
    return model.module(weights).layers()[0].attn


def random_tokens(seed, rows, vocab):
    """[rows, LENGTH] random tokens, a numpy array: sliced on the host, where a jax array's every slice (and every
    index of the logits below) would compile a program of its own."""
    return np.random.RandomState(seed).randint(0, vocab, (rows, LENGTH)).astype(np.int32)


def placed(model, cache):
    """A float32 cache of 32 positions laid out on the model's mesh as the engine lays it out, as the decode returns
    it: the decode's later calls then run the program its first one compiled (a cache not placed compiles it again)."""
    return jax.device_put(cache, CacheLayout.of(model.cfg.model).sharding(model.mesh, jnp.float32, 32))


def chunked_then_one_by_one(decode, weights, cache, tokens_1xL):
    """The logits [L, V] of two prefill chunks of 8 tokens into slot 2, then a token at a time; the cache."""
    slot_1, pieces = np.asarray([2], np.int32), []
    for start in (0, 8):
        logits, cache = decode(weights, cache, tokens_1xL[:, start:start + 8], np.asarray([start], np.int32), slot_1)
        pieces.append(np.asarray(logits)[0])
    for position in range(16, tokens_1xL.shape[1]):
        logits, cache = decode(weights, cache, tokens_1xL[:, position:position + 1], np.asarray([position], np.int32),
                               slot_1)
        pieces.append(np.asarray(logits)[0])
    return np.concatenate(pieces), cache


def test_chunked_prefill_then_decode_gives_the_full_forward_logits(tiny):
    model, weights, forward = tiny
    m = model.cfg.model
    tokens_1xL = random_tokens(0, 1, m.vocab_size)
    decode = jax.jit(lambda w, c, t, s, r: model.module(w).decode(t, c, s, r))
    cache = placed(model, KVCache.empty(m.num_layers, 3, 32, m.kv_heads, m.head_size, jnp.float32))
    got_LxV, cache = chunked_then_one_by_one(decode, weights, cache, tokens_1xL)
    np.testing.assert_allclose(got_LxV, np.asarray(forward(weights, tokens_1xL))[0], atol=1e-5, rtol=0)
    assert not np.any(np.asarray(cache.k)[:, [0, 1]]), "other slots' rows are untouched"


@pytest.mark.parametrize("name", ["tiny", "latent"])
def test_a_chunk_and_decode_rows_in_one_pass_equal_the_two_passes(name, tiny, latent):
    """Transformer.decode_groups (a serving step that takes a prefill chunk along): the chunk into slot 2 and
    single tokens of slots 0 and 1 in one pass give the logits and the cache of the chunk's pass then the rows'
    (grouped key/value heads, and latent attention, which expands its heads for the chunk and absorbs them
    for the rows)."""
    model, weights = (tiny if name == "tiny" else latent)[:2]
    m = model.cfg.model
    rng = np.random.RandomState(5)
    chunk_1xC = jnp.asarray(rng.randint(0, m.vocab_size, (1, 8)), jnp.int32)
    rows_2x1 = jnp.asarray(rng.randint(0, m.vocab_size, (2, 1)), jnp.int32)
    start_1, slot_1, positions_2, lengths_1 = jnp.asarray([4]), jnp.asarray([2]), jnp.asarray([3, 6]), jnp.asarray([6])
    cache = CacheLayout.of(m).empty(3, 32, jnp.float32)
    cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), cache)  # earlier tokens

    @jax.jit
    def apart(w, c):
        chunk_logits, c = model.module(w).decode(chunk_1xC, c, start_1, slot_1, 16, lengths_1)
        rows_logits, c = model.module(w).decode(rows_2x1, c, positions_2, span=16)
        return chunk_logits, rows_logits, c

    @jax.jit
    def together(w, c):
        (chunk_logits, rows_logits), c = model.module(w).decode_groups(
            [(chunk_1xC, start_1, slot_1, lengths_1), (rows_2x1, positions_2, None, None)], c, 16)
        return chunk_logits, rows_logits, c

    want, got = apart(weights, cache), together(weights, cache)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert w.shape == g.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)


def test_latent_attention_decodes_through_its_latents_as_the_full_forward(latent):
    """Every position's logits through the latent cache (the latent and the rotary key a token and layer,
    nothing per head; decoding absorbs the heads' up-projections, trainer/mla.py) equal the full forward's."""
    model, weights, forward, decode = latent
    m = model.cfg.model
    tokens_1xL = random_tokens(0, 1, m.vocab_size)
    cache = placed(model, CacheLayout.of(m).empty(3, 32, jnp.float32))
    assert cache.latent.shape == (m.num_layers, 3, 32, m.mla.kv_lora_rank)
    assert cache.rope.shape == (m.num_layers, 3, 32, m.mla.qk_rope_head_dim)
    got_LxV, cache = chunked_then_one_by_one(decode, weights, cache, tokens_1xL)
    np.testing.assert_allclose(got_LxV, np.asarray(forward(weights, tokens_1xL))[0], atol=1e-5, rtol=0)
    assert not any(np.any(np.asarray(a)[:, [0, 1]]) for a in jax.tree.leaves(cache)), "other slots untouched"


def test_a_long_latent_prefill_chunk_expands_the_heads_and_gives_the_full_forward_logits(latent, latent_attention):
    """A prompt prefilled as one chunk of LENGTH tokens, long enough that expanding the span's keys and values
    from their latents costs fewer FLOPs than absorbing the up-projections (MLAttention.expands; the test
    above decodes chunks of 8 and single tokens absorbed), gives the full forward's logits too."""
    model, weights, forward, decode = latent
    m = model.cfg.model
    attention = latent_attention
    assert attention.expands(LENGTH, 32) and not attention.expands(8, 32) and not attention.expands(1, 32)
    tokens_1xL = random_tokens(1, 1, m.vocab_size)
    logits, _ = decode(weights, CacheLayout.of(m).empty(3, 32, jnp.float32), tokens_1xL, np.asarray([0], np.int32),
                       np.asarray([1], np.int32))
    np.testing.assert_allclose(np.asarray(logits)[0], np.asarray(forward(weights, tokens_1xL))[0], atol=1e-5, rtol=0)


def test_the_latent_cache_split_by_position_over_model_decodes_as_the_full_forward(latent, latent_attention):
    """On data=2,model=4 the latent cache holds a quarter of the positions on each device (max_len / 4, as the
    start-up memory check counts it). Two rows (over `data`) prefill 17 tokens in one chunk, written over
    three devices' positions and expanded from the latents gathered, then decode a token at a time over a span
    of 24, each device's softmax over its own positions (the last device's all outside the span) merged: every
    position's logits are the full forward's, and a decode step gathers no part of the cache."""
    one, one_weights, forward, _ = latent
    m = one.cfg.model
    model = build_serving_model(one.cfg, sharding.make_mesh({"data": 2, "expert": 1, "model": 4}, jax.devices()[:8]))
    weights = jax.device_put(one_weights, {k: model.shardings[k] for k in one_weights})
    layout = CacheLayout.of(m)
    cache = jax.device_put(layout.empty(2, 32, jnp.float32), layout.sharding(model.mesh, jnp.float32, 32))
    assert cache.latent.sharding.spec[2] == "model" and cache.latent.addressable_shards[0].data.shape[2] == 8
    assert memory_plan(model, 2, 32, "float32", None)["kv_cache"] == sum(
        a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(cache)) == layout.nbytes(2, 32, "float32") // 4
    decode = jax.jit(lambda w, c, t, s, span: model.module(w).decode(t, c, s, span=span), static_argnums=4)
    tokens_2xL = random_tokens(2, 2, m.vocab_size)
    assert latent_attention.expands(17, 32)  # the one-device model's layer: expands reads the config alone
    logits, cache = decode(weights, cache, tokens_2xL[:, :17], np.asarray([0, 0], np.int32), None)
    pieces = [np.asarray(logits)]
    step = decode.lower(weights, cache, tokens_2xL[:, 17:18], np.asarray([17, 17], np.int32), 24).compile()
    for position in range(17, LENGTH):
        logits, cache = step(weights, cache, tokens_2xL[:, position:position + 1], np.asarray([position] * 2, np.int32))
        pieces.append(np.asarray(logits))
    expected = [np.asarray(forward(one_weights, tokens_2xL[row:row + 1]))[0] for row in range(2)]
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.stack(expected), atol=1e-5, rtol=0)
    gathered = [np.prod([int(d) for d in dims.split(",")]) for dims in
                re.findall(r"f32\[([\d,]+)\]\S* all-gather(?:-start)?\(", step.as_text())]
    assert gathered and max(gathered) < 2 * 32 * m.mla.kv_lora_rank  # a layer's latents of the two slots


def test_the_int8_latent_cache_attends_close_to_float(latent):
    """int8 latents and rotary keys with a float32 scale each a position: under a third of float32's bytes,
    and one layer's attention through it (two prefill chunks, then a token at a time) within 2% of the
    layer's full forward (which the float cache gives: the test above). Held at one layer: a random model's
    routing flips at near ties for any change of its input, and would measure those."""
    model, weights, *_ = latent
    m = model.cfg.model
    layout = CacheLayout.of(m)
    values = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    assert layout.nbytes(3, 32, "int8") == (values + 8) / (4 * values) * layout.nbytes(3, 32, "float32")
    assert layout.nbytes(3, 32, "int8") < layout.nbytes(3, 32, "float32") / 3

    @jax.jit
    def through_the_cache(w, x_1xLxD, cache):
        attention, pieces = model.module(w).layers()[1].attn, []
        for start, stop in ((0, 8), (8, 16), *((p, p + 1) for p in range(16, LENGTH))):
            out, view = attention(x_1xLxD[:, start:stop], cache=cache.layer(1, jnp.asarray([start]), jnp.asarray([2])))
            cache = view.cache
            pieces.append(out)
        return jnp.concatenate(pieces, axis=1), attention(x_1xLxD), cache

    x_1xLxD = jax.random.normal(jax.random.key(0), (1, LENGTH, m.d_model))
    got, full, cache = through_the_cache(weights, x_1xLxD, layout.empty(3, 32, "int8"))
    assert cache.latent.dtype == cache.rope.dtype == jnp.int8
    got, full = np.asarray(got), np.asarray(full)
    error = float(np.abs(got - full).max() / np.abs(full).max())
    assert 0 < error <= 0.02, error
    engine = Engine(model, weights, slots=2, max_len=32, chunk=8, kv_dtype="int8")  # the engine's, as laid out
    assert [a.dtype for a in jax.tree.leaves(engine.cache)] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
    assert memory_plan(model, 2, 32, "int8", None)["kv_cache"] == sum(a.nbytes for a in jax.tree.leaves(engine.cache))


def random_requests(rng, count, vocab, max_prompt, max_new):
    return [Request(rng.randint(0, vocab, rng.randint(1, max_prompt + 1)).tolist(),
                    SamplingParams(max_tokens=int(rng.randint(1, max_new + 1)))) for _ in range(count)]


def alone_then_together(engine, requests):
    alone = []
    for r in requests:
        single = engine.submit(Request(r.prompt, r.sampling))
        engine.run()
        alone.append(single.output)
    for r in requests:
        engine.submit(r)
    engine.run()
    return alone, [r.output for r in requests]


# The tiny engines' context: spans 128 and 192 (trainer/serve/spans.py), the longest one capped at max_len rather
# than doubled. Two spans are what the span tests need (a step at each, the mixed programs' rows over a span
# shorter than the chunk's); each span is three programs more an engine (four with mixed prefill) to compile.
MAX_LEN = 192


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    engine = Engine(*tiny[:2], slots=8, max_len=MAX_LEN, chunk=16)
    engine.warm_up(every_span=True)  # as a server does by default (serve --warm-up all): the requests compile nothing
    return engine


def thirty_two_requests():
    """Prompts of 1-168 tokens, 1-24 new ones, greedy: every span of MAX_LEN's."""
    return random_requests(np.random.RandomState(1), 32, 256, MAX_LEN - 24, 24)


@pytest.fixture(scope="module")
def alone(tiny_engine):
    """What each of thirty_two_requests() returns run alone on one device."""
    requests = thirty_two_requests()
    for r in requests:
        tiny_engine.submit(r)
        tiny_engine.run()
    return [r.output for r in requests]


def test_concurrent_greedy_requests_return_what_they_return_alone_and_compile_once(tiny_engine, alone):
    engine = tiny_engine
    # The prefill chunk at every span of the cache read, the decode step at every span and row count (one slot,
    # every slot), each compiled once, all in the warm-up.
    runner = engine.runner
    assert runner.rows() == [1, engine.slots]
    assert engine.compilations() == len(runner.programs) == runner.programs_bound() == 3 * len(runner.spans())
    requests = thirty_two_requests()
    for r in requests:
        engine.submit(r)
    engine.run()
    assert [r.output for r in requests] == alone
    assert [len(o) for o in alone] == [r.sampling.max_tokens for r in requests]
    # 200 more requests of random lengths: no program compiles again, and no more than a span each.
    rng = np.random.RandomState(2)
    for r in random_requests(rng, 200, 256, 40, 8):
        engine.submit(r)
    engine.run()
    assert engine.compilations() == len(runner.programs) == runner.programs_bound()
    assert {name.split("/")[2] for name in runner.calls if name.startswith("decode/")} == {"1", str(engine.slots)}
    assert engine.free and sorted(engine.free) == list(range(engine.slots)) and not engine.busy


def test_compiling_ahead_serves_meanwhile_and_leaves_nothing_to_compile(tiny, tiny_engine):
    """serve --warm-up background: ready once the first two programs ran, the rest compiled on a thread while a
    request reaching the longest span is answered as on an engine warmed at every span (its step compiles what
    the thread has not reached, or waits for the one it is compiling); then no request traces or compiles."""
    model = dataclasses.replace(tiny[0])  # programs of its own (ServingModel.programs): tiny_engine's are compiled
    engine = Engine(model, tiny[1], slots=8, max_len=MAX_LEN, chunk=16)
    runner = engine.runner
    engine.warm_up()
    order = runner.warm_up_order()
    assert order[:FIRST_PROGRAMS] == ["prefill/128", "decode/128/1"] and runner.compiled == set(order[:2])
    assert sorted(order) == sorted(tiny_engine.runner.programs)
    ahead = threading.Thread(target=engine.compile_ahead)
    ahead.start()
    prompt = np.random.RandomState(3).randint(0, 256, MAX_LEN - 12).tolist()  # its chunks reach every span
    request = engine.submit(Request(prompt, SamplingParams(max_tokens=8)))
    engine.run()
    ahead.join(timeout=300)
    assert not ahead.is_alive() and runner.compiled == set(order) and not runner._ahead
    reference = tiny_engine.submit(Request(prompt, SamplingParams(max_tokens=8)))
    tiny_engine.run()
    assert request.output == reference.output and len(request.output) == 8
    compiled = []
    listener = lambda name, *_, **__: compiled.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for r in random_requests(np.random.RandomState(4), 4, 256, MAX_LEN - 8, 8):
            engine.submit(r)
        engine.run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [name for name in compiled if "/jax/core/compile/" in name] == []
    assert set(runner.calls) <= set(order) and runner.first_calls == len(runner.calls)  # loop.stuck's count


def test_a_lone_request_decodes_on_one_row_and_returns_what_it_returns_beside_another(tiny_engine):
    """The decode step runs the first rows that cover the live slots (the scheduler fills the lowest free ones):
    one row while a request decodes alone, every slot beside another request, and one row again once that one
    ended; each request's tokens are the same either way."""
    runner = tiny_engine.runner

    def decodes(requests):
        before = collections.Counter(runner.calls)
        for r in requests:
            tiny_engine.submit(r)
        tiny_engine.run()
        ran = runner.calls - before
        return [ran[f"decode/{runner.spans()[0]}/{rows}"] for rows in (1, tiny_engine.slots)]

    alone = [Request([4, 8, 15], SamplingParams(max_tokens=12)), Request([16, 23, 42], SamplingParams(max_tokens=4))]
    for r in alone:
        ran = decodes([r])
        assert ran == [r.sampling.max_tokens - 1, 0]  # the first token comes from the prefill
    together = [Request(r.prompt, r.sampling) for r in alone]
    ones, alls = decodes(together)
    assert [r.output for r in together] == [r.output for r in alone]
    assert together[1].finish_reason == "length" and alls == 3 and ones == 12 - 1 - 3  # alone before and after


def test_greedy_decoding_continues_as_the_full_forward_pass_argmax(tiny, tiny_engine):
    _, weights, forward = tiny
    request = tiny_engine.submit(Request([7, 3, 250, 19, 4], SamplingParams(max_tokens=6)))
    tiny_engine.run()
    sequence = list(request.prompt)
    for _ in range(6):  # causal: the padding after the sequence does not change its last logits
        padded = jnp.asarray([sequence + [0] * (LENGTH - len(sequence))], jnp.int32)
        sequence.append(int(jnp.argmax(forward(weights, padded)[0, len(sequence) - 1])))
    assert request.output == sequence[5:]
    assert request.finish_reason == "length"


def test_sampling_depends_on_the_seed_alone_and_top_k_1_is_greedy(tiny_engine):
    hot = dict(max_tokens=12, temperature=1.5, top_p=0.95)
    requests = [Request([1, 2, 3], SamplingParams(seed=5, **hot)), Request([1, 2, 3], SamplingParams(seed=6, **hot)),
                Request([1, 2, 3], SamplingParams(seed=5, top_k=1, **hot)), Request([1, 2, 3], SamplingParams(12))]
    alone, together = alone_then_together(tiny_engine, requests)
    assert together == alone
    assert together[0] != together[1]
    assert together[2] == together[3]  # the best token only: the greedy choice


def test_stop_strings_cut_the_text_and_free_the_slot(tiny_engine):
    tiny_engine.detokenize = lambda ids: " ".join(map(str, ids))
    try:
        first = tiny_engine.submit(Request([9, 8, 7], SamplingParams(max_tokens=8)))
        tiny_engine.run()
        stop = f" {first.output[3]}"
        request = tiny_engine.submit(Request([9, 8, 7], SamplingParams(max_tokens=8, stop=(stop,))))
        tiny_engine.run()
    finally:
        tiny_engine.detokenize = None
    expected = " ".join(map(str, first.output))
    assert request.finish_reason == "stop"
    assert request.text == expected[:expected.find(stop)]
    assert len(request.output) <= 4


def test_bad_requests_are_refused_with_the_limit_named(tiny_engine):
    with pytest.raises(RequestError, match=f"maximum context length of {MAX_LEN} tokens"):
        tiny_engine.submit(Request([1] * (MAX_LEN - 6), SamplingParams(max_tokens=7)))
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 256\)"):
        tiny_engine.submit(Request([300], SamplingParams()))
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        tiny_engine.submit(Request([3], SamplingParams(stop=("x",))))
    assert not tiny_engine.busy


def test_a_cancelled_request_frees_its_slot_and_a_failing_one_fails_alone(tiny_engine):
    def explode(request):
        raise RuntimeError("listener broke")

    broken = Request([5, 6], SamplingParams(max_tokens=5), listener=explode)
    cancelled = Request([5, 6], SamplingParams(max_tokens=50))
    fine = Request([5, 6], SamplingParams(max_tokens=5))
    for r in (broken, cancelled, fine):
        tiny_engine.submit(r)
    tiny_engine.step()
    tiny_engine.step()
    cancelled.cancelled = True
    tiny_engine.run()
    assert broken.finish_reason == "error" and "listener broke" in broken.error
    assert cancelled.finish_reason == "cancelled" and len(cancelled.output) < 50
    assert fine.finish_reason == "length" and len(fine.output) == 5
    assert sorted(tiny_engine.free) == list(range(tiny_engine.slots))


def decode_calls(runner) -> int:
    return sum(n for name, n in runner.calls.items() if name.startswith("decode/"))


def test_the_next_decode_step_is_dispatched_before_the_last_ones_tokens_are_read(tiny_engine):
    """After each step of a lone request one decode step is in flight, its token not yet read: the request
    holds as many tokens as steps dispatched (the prefill's first one and every step's but the last). Its last
    token known ahead (max_tokens), no step runs past it."""
    runner, before = tiny_engine.runner, decode_calls(tiny_engine.runner)
    request = tiny_engine.submit(Request([3, 1, 4, 1, 5], SamplingParams(max_tokens=10)))
    held = []
    while tiny_engine.busy:
        tiny_engine.step()
        in_flight = tiny_engine.flight is not None and tiny_engine.flight.ran == {request.slot: request}
        held.append((len(request.output), decode_calls(runner) - before, in_flight))
    assert held == [(n, n, True) for n in range(1, 10)] + [(10, 9, False)]
    assert request.finish_reason == "length" and tiny_engine.flight is None


def test_a_steady_decode_step_sends_the_device_nothing(tiny_engine):
    """Once every live slot follows the step before (none starting or ending, no grammar), a decode step moves
    nothing from the host to the device, implicitly or explicitly: its packed inputs are those the step before
    returned (ModelRunner.step_inputs, following), the slots' sampling rows and masks those uploaded when the
    requests started. The tokens are those of the requests alone."""
    requests = [Request([3 + i, 1, 4], SamplingParams(max_tokens=30, temperature=0.5 * i, seed=i,
                                                      logprobs=2 if i == 1 else None)) for i in range(3)]
    alone, together = [], [tiny_engine.submit(Request(r.prompt, r.sampling)) for r in requests]
    while tiny_engine.scheduler.waiting or tiny_engine.scheduler.admitting is not None:
        tiny_engine.step()
    tiny_engine.step()  # every slot follows from here
    outputs = [len(r.output) for r in together]
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        for _ in range(8):
            tiny_engine.step()
    assert [len(r.output) for r in together] == [n + 8 for n in outputs]
    tiny_engine.run()
    for r in requests:
        alone.append(tiny_engine.submit(r))
        tiny_engine.run()
    assert [r.output for r in together] == [r.output for r in alone] and all(len(r.output) == 30 for r in alone)
    assert [len(r.logprobs) for r in together] == [0, 30, 0]
    np.testing.assert_allclose([x.logprob for x in together[1].logprobs], [x.logprob for x in alone[1].logprobs],
                               atol=1e-5, rtol=0)  # 8 rows against 1: the float sums may differ in the last bits


def test_a_request_ended_by_its_end_token_emits_nothing_after_it_and_its_slot_serves_the_next(tiny_engine):
    """A request ending at its end token ran in the step dispatched before that token was read: that step's
    token for it is dropped, and the request taking its slot meanwhile (while the step still runs) takes its
    first input from its own prefill, not from that step, and decodes what it decodes alone."""
    first, second, third = [7, 7, 2], [1, 9, 9, 6], [30, 31]
    probe = tiny_engine.submit(Request(first, SamplingParams(max_tokens=12)))
    tiny_engine.run()
    end = next(i for i in range(2, 12) if probe.output[i] not in probe.output[:i])
    tiny_engine.eos_id = probe.output[end]
    try:
        alone = []
        for prompt, most in ((first, 12), (second, 10), (third, 24)):
            alone.append(tiny_engine.submit(Request(prompt, SamplingParams(max_tokens=most))))
            tiny_engine.run()
        ending = tiny_engine.submit(Request(first, SamplingParams(max_tokens=12)))
        beside = tiny_engine.submit(Request(third, SamplingParams(max_tokens=24)))
        while ending.finish_reason is None:
            tiny_engine.step()
        assert tiny_engine.flight.ran.get(0) is ending and ending.slot is None  # a step ran it past its end
        following = tiny_engine.submit(Request(second, SamplingParams(max_tokens=10)))
        tiny_engine.step()
        assert following.slot == 0
        tiny_engine.run()
    finally:
        tiny_engine.eos_id = None
    assert ending.output == alone[0].output == probe.output[:end + 1] and ending.finish_reason == "stop"
    assert following.output == alone[1].output and beside.output == alone[2].output


def test_a_constrained_request_steps_synchronously_and_the_others_decode_as_alone(tiny_engine):
    """A grammar's mask of a slot's next token needs its last token on the host: while a constrained request
    runs no step is left in flight; once it ended the steps overlap again, and every request returns what it
    returns alone."""
    from trainer.serve.structured import Grammars

    grammars = Grammars("bytes", 256, None)
    grammar = grammars.grammar(None, {"regex": "[a-d]{6}"})
    plain = [Request([2, 7, 1], SamplingParams(max_tokens=16)), Request([8, 2, 8], SamplingParams(max_tokens=5))]
    alone = []
    for r in plain:
        alone.append(tiny_engine.submit(Request(r.prompt, r.sampling)))
        tiny_engine.run()
    constrained = Request([5, 5], SamplingParams(max_tokens=12), constraint=grammars.constraint(grammar))
    for r in (*plain, constrained):
        tiny_engine.submit(r)
    flights = []  # after each step: (whether the constrained request decodes, whether a step is in flight)
    while tiny_engine.busy:
        tiny_engine.step()
        flights.append((constrained in tiny_engine.scheduler.active.values(), tiny_engine.flight is not None))
    assert re.fullmatch("[a-d]{6}", bytes(constrained.output).decode()) and constrained.finish_reason == "stop"
    assert [r.output for r in plain] == [r.output for r in alone]
    assert all(not flying for running, flying in flights if running)
    assert any(flying for running, flying in flights if not running)


def test_experts_over_8_devices_serve_concurrent_requests_as_one_device_alone(tiny, alone):
    """The same 32 requests on 8 devices with expert=8, all at once: each returns, token for token, what it
    returns alone on one device. (A token a device at decode: fewer rows than the tiled FFN's longest span.
    deepseek-tiny, its shared expert and bias, decodes as its forward pass above; the MoE tests cover its
    layer on the mesh.)"""
    one, weights, _ = tiny
    mesh = sharding.make_mesh({"data": 1, "expert": 8}, jax.devices()[:8])
    model = build_serving_model(one.cfg, mesh)
    on_mesh = jax.device_put(weights, {k: model.shardings[k] for k in weights})
    w_in = on_mesh["params"]["stacks.0.0.ffn.w_in"]
    assert w_in.sharding.spec[1] == "expert"  # the experts are split over the mesh (every layer's alike)
    engine = Engine(model, on_mesh, slots=8, max_len=MAX_LEN, chunk=16)
    requests = thirty_two_requests()
    for r in requests:
        engine.submit(r)
    engine.run()
    assert [r.output for r in requests] == alone
    assert engine.compilations() == len(engine.runner.programs) <= engine.runner.programs_bound()


def test_the_model_runner_scores_a_prompt_in_chunks_as_the_full_forward_pass(tiny, tiny_engine):
    """The runner alone: a 40-token prompt prefilled in chunks of 16, each position's record holding the
    logprob of the token after it (the last: the token drawn) as the full forward pass's log-softmax."""
    _, weights, forward = tiny
    runner = tiny_engine.runner
    prompt = np.random.RandomState(4).randint(0, 256, 40).tolist()
    scored = []
    for start in range(0, len(prompt), runner.chunk):
        token, records = runner.prefill(prompt, start, 3, (0.0, 0, 1.0, 0), top=2, prompt_scores=True)
        scored += records
    runner.vacate(3)
    sequence = prompt + [token]
    padded = jnp.asarray([sequence + [0] * (LENGTH * 3 - len(sequence))], jnp.int32)
    expected = np.asarray(jax.nn.log_softmax(forward(weights, padded)[0], axis=-1))
    assert [r.token for r in scored] == sequence[1:]
    np.testing.assert_allclose([r.logprob for r in scored],
                               [expected[i, sequence[i + 1]] for i in range(len(prompt))], atol=1e-4, rtol=0)
    assert all(r.top_ids[0] == expected[i].argmax() and len(r.top_ids) == 2 for i, r in enumerate(scored))
    assert token == expected[len(prompt) - 1].argmax()
    assert runner.compilations() == len(runner.programs) <= runner.programs_bound()


def test_bursts_of_decode_steps_return_what_single_steps_do(tiny):
    """serve --decode-steps 4: while a lone stream decodes and nothing waits, a program runs 4 decode steps (the
    host dispatches and reads once), and every request, greedy or sampled, ended by max_tokens (fewer than a
    burst's too) or by its end token inside a burst, returns what an engine of single steps returns; requests
    waiting for a slot get their prefill between single steps. The bursts' programs are within
    programs_bound."""
    model, weights, _ = tiny
    engines = {steps: Engine(model, weights, slots=4, max_len=96, chunk=16, decode_steps=steps) for steps in (4, 1)}

    def served(steps, eos=None):
        engine = engines[steps]
        engine.eos_id = eos
        rng = np.random.RandomState(5)
        sampling = zip([30, 3, 17, 40, 9, 25], [0.0, 0.0, 1.0, 0.8, 0.0, 1.2], strict=True)
        requests = [Request(rng.randint(0, 256, int(rng.randint(1, 40))).tolist(),
                            SamplingParams(max_tokens=int(n), temperature=t, seed=i))
                    for i, (n, t) in enumerate(sampling)]
        for r in requests:  # six requests for four slots: two wait, then come in between steps
            engine.submit(r)
        engine.run()
        for r in requests[2:4]:  # alone, one after the other: a lone stream in slot 0
            requests.append(engine.submit(Request(r.prompt, r.sampling)))
            engine.run()
        return [(r.output, r.finish_reason) for r in requests]

    first = served(1)
    eos = first[0][0][10]  # a token the first (greedy) request draws at its 11th: it then ends there
    single = served(1, eos)
    assert single[0][0] == first[0][0][:first[0][0].index(eos) + 1] and single[0][1] == "stop"
    assert served(4, eos) == single and served(4) == first
    assert len(first[1][0]) == 3 and first[1][1] == "length"
    calls = {steps: sum(n for name, n in e.runner.calls.items() if name.startswith("decode/"))
             for steps, e in engines.items()}
    bursts = engines[4].runner
    assert any(name.count("/") == 3 for name in bursts.calls) and calls[4] < calls[1]
    assert engines[4].compilations() == len(bursts.programs) <= bursts.programs_bound()


def test_a_prefill_chunk_taken_along_by_the_decode_step_returns_what_its_own_program_does(tiny, tiny_engine, alone):
    """serve --mixed-prefill (an accelerator's default): while requests decode, the admitted request's prefill
    chunks go with the decode step in one program ("mixed/<span>/<decode span>": the weights read once for
    both, the decoding rows attending over their own span, the chunk over its). Every request returns what it
    returns alone; a sampled one and one scoring its prompt (echo with logprobs) what they return beside
    others with chunks in programs of their own; the mixed programs ran, some with the rows' span shorter than
    the chunk's, within programs_bound; a request cancelled while its last chunk is in flight frees its slot."""
    engine = Engine(*tiny[:2], slots=8, max_len=MAX_LEN, chunk=16, mixed_prefill=True)
    runner = engine.runner
    assert runner.mixed and not tiny_engine.runner.mixed  # a CPU's default: off
    requests = thirty_two_requests()
    extra = lambda: [Request(list(range(1, 60)), SamplingParams(max_tokens=5, temperature=0.8, seed=3)),  # noqa: E731
                     Request(list(range(60, 100)), SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=True))]
    mine, theirs = extra(), extra()
    for r in requests + mine:
        engine.submit(r)
    engine.run()
    assert [r.output for r in requests] == alone
    for r in requests[:3] + theirs:
        tiny_engine.submit(Request(r.prompt, r.sampling) if r in requests else r)
    tiny_engine.run()
    assert [r.output for r in mine] == [r.output for r in theirs]
    assert [r.token for r in mine[1].prompt_logprobs] == list(range(61, 100))
    np.testing.assert_allclose([r.logprob for r in mine[1].prompt_logprobs + mine[1].logprobs],
                               [r.logprob for r in theirs[1].prompt_logprobs + theirs[1].logprobs], atol=1e-4)
    mixed = {name for name in runner.calls if name.startswith("mixed/")}
    spans = {name: tuple(int(span) for span in name.split("/")[1:]) for name in mixed}
    assert mixed and all(own <= span and span in runner.spans() and own in runner.spans()
                         for span, own in spans.values())
    assert any(own < span for span, own in spans.values())  # the streams over their own span, not the prompt's
    assert engine.compilations() == len(runner.programs) <= runner.programs_bound()
    assert set(runner.warm_up_order()) >= mixed and len(runner.warm_up_order()) == runner.programs_bound()
    # The server's background compile and its warm-up take the mixed programs too (their example inputs).
    engine.compile_ahead()
    engine.warm_up(every_span=True)
    assert engine.compilations() == len(runner.programs) == runner.programs_bound()
    # Cancelled while its last chunk is in flight: nothing of it is emitted, and its slot serves the next.
    streaming = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=20)))
    engine.step()
    cancelled = engine.submit(Request([9, 10, 11], SamplingParams(max_tokens=4)))
    engine.step()  # its one chunk goes with the step
    assert engine.flight is not None and engine.flight.chunk is not None and engine.flight.chunk[0] is cancelled
    cancelled.cancelled = True
    engine.run()
    assert cancelled.finish_reason == "cancelled" and not cancelled.output and len(streaming.output) == 20
    assert sorted(engine.free) == list(range(engine.slots)) and not engine.busy
