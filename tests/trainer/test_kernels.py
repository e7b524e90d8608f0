"""The TPU kernels' paths against their XLA references, on the CPU: splash attention and megablox through
Pallas' interpreter, the loss in chunks, and the remat policies (tests/trainer/test_tpu.py holds the same on a
chip)."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer.attention import causal_attention, resolve
from trainer.config import ConfigError, load_config
from trainer.model import build_model
from trainer.model import cross_entropy as model_cross_entropy
from trainer.moe.gmm import grouped_matmul, stacked_tiling, tiling
from trainer.sharding import make_mesh
from trainer.step import StepCompiles, TieredStep, build_trainer, compile_in_background, compile_step


def normal(seed, *shape):
    """A float32 array of normal draws, numpy's: jax.random would compile programs for every shape it draws."""
    return np.random.default_rng(seed).standard_normal(shape, np.float32)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_splash_attention_matches_xla_with_its_gradients(kv_heads):
    """Multi-head and grouped-query (two query heads a key/value head): output and the q, k, v gradients."""
    q = jax.random.normal(jax.random.key(0), (2, 128, 4, 32))
    k, v = (jax.random.normal(jax.random.key(i), (2, 128, kv_heads, 32)) for i in (1, 2))
    target = jax.random.normal(jax.random.key(3), q.shape)

    def loss(impl):
        return lambda q, k, v: jnp.sum(causal_attention(q, k, v, impl=impl, scale=0.3) * target)

    got = jax.jit(jax.value_and_grad(loss("splash"), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert relative_error(g, w) < 1e-5


def test_auto_attention_is_xla_off_a_tpu_and_splash_refuses_ragged_lengths():
    assert resolve("auto", 1024, 128, 128) == "xla"  # this CPU
    assert resolve("splash", 100, 64, 64) == "splash"
    with pytest.raises(ValueError, match="multiple of 128"):
        causal_attention(*(jnp.zeros((1, 100, 2, 16)),) * 3, impl="splash")
    with pytest.raises(ConfigError, match="model.attention=splash needs data.seq_len a multiple of 128"):
        load_config("tiny", ["model.attention=splash"])
    with pytest.raises(ConfigError, match=r"train.loss_chunk \(48\) must divide data.seq_len \(64\)"):
        load_config("tiny", ["train.loss_chunk=48"])


def test_megablox_matches_ragged_dot_with_empty_groups():
    """Blocks of 128 rows over four experts, one with none, rows past the used blocks zero: forward and the
    gradients of rows and weights."""
    x = normal(0, 1024, 256)
    w = normal(1, 4, 256, 384)
    block_group, used = jnp.array([0, 0, 1, 3, 3, 3, 0, 0], jnp.int32), jnp.array(6)
    x = x * (np.arange(1024) < 6 * 128)[:, None]

    def run(impl):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(grouped_matmul(x, w, block_group, used, impl) ** 2),
                                          argnums=(0, 1)))(x, w)

    for g, want in zip(jax.tree.leaves(run("megablox")), jax.tree.leaves(run("ragged_dot")), strict=True):
        assert relative_error(g, want) < 1e-5
    assert tiling(36864, 1024, 2816) == (512, 1024, 512)
    assert tiling(40, 64, 2816) == (40, 64, 512)
    # a decode step's rows: at most 4 tiles of them, or one tile (136 = 8 x 17); a long prefill's, 512 a tile
    assert [stacked_tiling(m, 1024, 2816)[0] for m in (136, 192, 256, 4608)] == [136, 64, 64, 512]
    # 1,024 columns for tiles of up to 256 rows, 512 for larger ones; never more than the weight has
    assert [stacked_tiling(m, 2816, 1024)[1:] for m in (136, 4608)] == [(1024, 1024), (1024, 512)]
    assert stacked_tiling(192, 1024, 2816)[2] == 1024 and stacked_tiling(8, 64, 256)[1:] == (64, 256)


def loss_and_grads(state, overrides, chunk=0, autodiff=False):
    """The loss and its gradients of the model `overrides` make, on `state` (its parameters and the rest: the
    overrides below change the model's graph, not its state)."""
    cfg = load_config("tiny", ["model.moe_every=2", *overrides])
    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=0)), nnx.Param, ...)  # its shapes alone
    params, rest = state
    tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), np.int32)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        x, _ = m.features(tokens[:, :-1], train=False)
        if autodiff:  # the whole logits' loss as autodiff differentiates it: the reference
            return model_cross_entropy(m._logits(x), tokens[:, 1:])
        return m.cross_entropy(x, tokens[:, 1:], chunk)

    return jax.jit(jax.value_and_grad(loss))(params)


def test_the_attention_moe_policy_keeps_the_capacity_paths_slots_tokens_and_outputs():
    """Under remat "attention_moe" the backward pass does not redo the MoE layer's sort, its gather of the
    tokens into their slots or its down projection: the gradient's program holds one sort where "attention"
    holds two (the forward's, and its rematerialised copy's), and fewer gathers and matmuls."""
    def counts(policy):
        cfg = load_config("tiny", ["model.moe_every=2", "model.remat=true", f"model.remat_policy={policy}"])
        # the model's shapes alone (the program is read, never run): nothing initialised op by op
        graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=0)), nnx.Param, ...)
        tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, cfg.data.seq_len), np.int32)
        loss = lambda p, r: jnp.mean(nnx.merge(graphdef, p, r)(tokens, train=True)[0])  # noqa: E731
        text = jax.jit(jax.grad(loss)).lower(params, rest).as_text()
        return [text.count(f"stablehlo.{op}") for op in ("sort", "gather", "dot_general")]

    (sorts, gathers, dots), (kept_sorts, kept_gathers, kept_dots) = counts("attention"), counts("attention_moe")
    assert (sorts, kept_sorts) == (2, 1) and kept_gathers < gathers and kept_dots < dots


def test_the_loss_in_chunks_and_every_remat_policy_give_the_whole_loss_and_its_gradients():
    """The loss's written-out backward pass (trainer/loss.py), whole or in chunks, under every remat policy:
    the loss and the gradients autodiff gives for the whole float32 logits."""
    cfg = load_config("tiny", ["model.moe_every=2"])
    _, *state = nnx.split(nnx.jit(lambda: build_model(cfg, seed=0))(), nnx.Param, ...)  # in one program, not op by op
    (want, want_grads) = loss_and_grads(state, ["model.remat=false"], autodiff=True)
    cases = [(["model.remat=false"], 16),
             (["model.remat=true", "model.remat_policy=full"], 0),
             (["model.remat=true", "model.remat_policy=attention"], 32),
             (["model.remat=true", "model.remat_policy=attention_ffn"], 0),
             (["model.remat=true", "model.remat_policy=attention_moe"], 0)]
    for overrides, chunk in cases:
        got, grads = loss_and_grads(state, overrides, chunk)
        assert float(got) == pytest.approx(float(want), rel=1e-6), (overrides, chunk)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            assert relative_error(g, w) < 1e-5, (overrides, chunk)


def test_the_step_compiled_in_the_background_is_the_step():
    """The train step compiled on its thread while the state is made (as on an accelerator) takes the same
    step as one compiled in line: the same loss and parameters after it."""
    # No kept program (trainer/program_cache.py): this compiles the step, in the background and in line.
    cfg = load_config("tiny", ["model.num_layers=1", "train.program_cache=false"])
    trainer = build_trainer(cfg, make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1]), 10)
    assert compile_in_background(trainer) is None  # a CPU, by default
    trainer.step_compiling = compile_in_background(trainer, on_cpu=True)
    state = trainer.initial_state()
    background = compile_step(trainer)
    assert trainer.step_compiling is None
    tokens = jax.random.randint(jax.random.key(0), (cfg.data.global_batch_size, cfg.data.seq_len + 1), 0, 64)
    batch = jax.device_put(tokens, trainer.batch_sharding)
    again = jax.tree.map(jnp.copy, state)
    got, got_metrics = background(state, batch)
    want, want_metrics = compile_step(trainer)(again, batch)
    assert float(got_metrics["loss"]) == float(want_metrics["loss"])
    for g, w in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_kept_step_loads_on_a_thread_beside_the_initial_state_and_takes_the_same_step(own_compilation_cache):
    """A restart whose train step an earlier run kept (trainer/program_cache.py): compile_in_background loads
    it on a thread of its own, nothing traced, while the initial state is made, and it takes the step the
    compiled one takes."""
    import threading

    from trainer import program_cache

    cfg = load_config("tiny", ["model.num_layers=1"])
    mesh = make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1])
    threads: list[str] = []
    heard = lambda name, *_, **__: threads.append(threading.current_thread().name) \
        if name == program_cache.LOADED_EVENT else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        first = build_trainer(cfg, mesh, 10)
        compiled = compile_step(first)
        assert program_cache.kept(first.program_keys["step"]) and not threads
        again = build_trainer(cfg, mesh, 10)
        again.step_compiling = compile_in_background(again, on_cpu=True)
        state = again.initial_state()
        loaded = compile_step(again)
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    assert "step" in again.loaded and threads and all(t.startswith("load-step") for t in threads)
    tokens = jax.random.randint(jax.random.key(0), (cfg.data.global_batch_size, cfg.data.seq_len + 1), 0, 64)
    batch = jax.device_put(tokens, again.batch_sharding)
    want = jax.tree.map(jnp.copy, state)
    got, got_metrics = loaded(state, batch)
    want, want_metrics = compiled(want, batch)
    assert float(got_metrics["loss"]) == float(want_metrics["loss"])
    for g, w in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_first_steps_run_on_the_quick_program_until_the_optimised_one_is_ready_and_take_the_same_steps():
    """A TieredStep runs the quickly compiled step while the optimised compile is under way, says so once when
    that one takes over, and then keeps to it; the state passes between them, and the steps are the ones a
    single program takes (the same losses, the parameters within float rounding)."""
    cfg = load_config("tiny", ["model.num_layers=1", "train.program_cache=false"])  # compiled, not a kept one
    trainer = build_trainer(cfg, make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1]), 10)
    compiles = compile_in_background(trainer, on_cpu=True, quick=True)  # the quick program, then the optimised one
    full, quick = compiles.full.result(), compiles.quick.result()
    assert quick is not full
    held = concurrent.futures.Future()  # the optimised compile, finished when the test says
    heard = []
    tiered = StepCompiles(held, compiles.quick).program(heard.append)
    assert isinstance(tiered, TieredStep) and not tiered.optimised
    tokens = jax.random.randint(jax.random.key(0), (4, cfg.data.global_batch_size, cfg.data.seq_len + 1), 0, 64)
    batches = [jax.device_put(t, trainer.batch_sharding) for t in tokens]
    state = trainer.initial_state()
    alone = jax.tree.map(jnp.copy, state)
    losses = []
    for i, batch in enumerate(batches):
        if i == 2:
            held.set_result(full)
        state, metrics = tiered(state, batch)
        losses.append(float(metrics["loss"]))
    assert tiered.optimised and tiered.quick_steps == 2 and tiered.current is full
    assert len(heard) == 1 and "the 2 step(s) before it ran on the quickly compiled one" in heard[0]
    want = []
    for batch in batches:
        alone, metrics = full(alone, batch)
        want.append(float(metrics["loss"]))
    assert losses == pytest.approx(want, rel=1e-6)
    for g, w in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(alone["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_a_failed_quick_compile_leaves_the_optimised_step_to_wait_for():
    """The quick program's compile failing costs nothing but its time: the optimised program is returned."""
    failed, full = concurrent.futures.Future(), concurrent.futures.Future()
    failed.set_exception(RuntimeError("quick compile failed"))
    full.set_result("the optimised program")
    assert StepCompiles(full, failed).program() == "the optimised program"
    assert StepCompiles(full, None).program() == "the optimised program"


def test_splash_attention_on_a_mesh_runs_each_devices_rows_and_heads():
    """On a mesh of four devices (batch over data, heads over model) the kernel runs per device under
    shard_map and gives XLA's attention over the whole arrays."""
    from trainer import sharding

    mesh = make_mesh({"data": 2, "expert": 1, "model": 2}, jax.devices()[:4])
    q, k, v = (normal(i, 4, 128, 4, 16) for i in range(3))
    with sharding.logical_mesh(mesh):
        got = jax.jit(lambda q, k, v: causal_attention(q, k, v, impl="splash"))(q, k, v)
    want = jax.jit(lambda q, k, v: causal_attention(q, k, v, impl="xla"))(q, k, v)  # one program, not op by op
    assert relative_error(got, want) < 1e-5

