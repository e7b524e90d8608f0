"""Structure of the compiled expert-parallel block, read from the HLO text: exactly two
all-to-all collectives per MoE block, one all-reduce of its statistics, and no all-gather of
expert weights.

Collectives are counted along one execution path: a conditional runs one of its
branches, so its branches must hold the same collectives and count once; the loop of
the CPU dropless exchange's extra rounds runs only when a send is longer than a
round's chunk (skewed routing), so balanced routing's path leaves it out.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.moe import MoEConfig, core
from trainer.moe.exchange import EXTRA_ROUNDS
from trainer.moe.experts import ExpertWeights
from trainer.moe.parallel import moe_apply

B, L, D, F, E = 16, 8, 16, 32, 8
# "%name = <shape, maybe a tuple> <op>(operands...)", one instruction per line.
COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?\S+\s*=\s*(.*?)\s(all-to-all|all-gather-start|all-gather|ragged-all-to-all|all-reduce)\("
)


@functools.cache
def mesh(shape):
    return jax.make_mesh(shape, ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def sharded_inputs(m, num_blocks):
    keys = jax.random.split(jax.random.key(0), 2 + 3 * num_blocks)
    put = lambda a, spec: jax.device_put(a, NamedSharding(m, spec))
    x = put(jax.random.normal(keys[0], (B, L, D)), P(("data", "expert")))
    router = put(jax.random.normal(keys[1], (D, E)), P())
    shapes = ((E, D, F), (E, D, F), (E, F, D))
    normal = lambda i, j, shape: jax.random.normal(keys[2 + 3 * i + j], shape) * 0.1
    weights = [
        ExpertWeights(*(put(normal(i, j, shape), P("expert")) for j, shape in enumerate(shapes)))
        for i in range(num_blocks)
    ]
    return x, router, weights


def stacked_blocks(x, router, weights, cfg, m):
    """num_blocks MoE blocks with residuals, as a model stacks them."""
    for w in weights:
        y, _ = moe_apply(x, router, w, cfg, m, train=True)
        x = x + y
    return x


COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{$")
BRANCHES = re.compile(r"\bconditional\(.*branch_computations=\{([^}]*)\}")
CALLED = re.compile(r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")


def executed_collectives(hlo: str, pick=None) -> list[tuple[str, str]]:
    """(kind, shape) of the collectives one execution of the module runs, in program order.

    At a conditional, pick chooses among the branches' lists (default: the first; all must hold the same kinds);
    the loops of the padded exchange's extra rounds do not run."""
    computations, entry, current = {}, None, None
    for line in hlo.splitlines():
        if (m := COMPUTATION.match(line)) is not None:
            current = computations.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif current is not None:
            current.append(line)

    def walk(name: str) -> list[tuple[str, str]]:
        found = []
        for line in computations[name]:
            if (m := COLLECTIVE.match(line)) is not None:
                found.append((m.group(2), m.group(1)))
            if (b := BRANCHES.search(line)) is not None:
                paths = [walk(branch.strip().lstrip("%")) for branch in b.group(1).split(",")]
                assert all([k for k, _ in p] == [k for k, _ in paths[0]] for p in paths), paths
                found += paths[0] if pick is None else pick(paths)
            if f"/{EXTRA_ROUNDS}/" in line and re.search(r"\swhile\(", line):
                continue
            for called in CALLED.findall(line):
                found += walk(called)
        return found

    return walk(entry)


def collectives(cfg, mesh_shape, num_blocks=1, grad=False, with_aux=False):
    """The collectives of num_blocks stacked blocks (forward, or with grad forward and backward);
    with_aux the block's losses and balance metrics are computed too, as a model's are. Compiled once per set of
    arguments and value of core.MERGED_COUNTS_LIMIT (the block reads it as it is traced): the tests that ask for
    the same program read one compile of it."""
    return _collectives(cfg, mesh_shape, num_blocks, grad, with_aux, core.MERGED_COUNTS_LIMIT)


@functools.cache
def _collectives(cfg, mesh_shape, num_blocks, grad, with_aux, merged_counts_limit):
    del merged_counts_limit  # in the cache's key only: the block reads core.MERGED_COUNTS_LIMIT as it is traced
    m = mesh(mesh_shape)
    x, router, weights = sharded_inputs(m, num_blocks)
    fn = lambda x, w: stacked_blocks(x, router, w, cfg, m)
    if with_aux:
        def fn(x, w):
            y, aux = moe_apply(x, router, w[0], cfg, m, train=True)
            return y, aux["aux_loss"] + aux["z_loss"], aux["load_max_over_mean"], aux["drop_fraction"]
    if grad:
        fn = jax.grad(lambda x, w: jnp.sum(stacked_blocks(x, router, w, cfg, m)), argnums=(0, 1))
    return tuple(executed_collectives(jax.jit(fn).lower(x, weights).compile().as_text()))


CONFIGS = {
    "capacity": MoEConfig(num_experts=E, d_ff=F),
    "dropless": MoEConfig(num_experts=E, d_ff=F, capacity_factor=0.0, block_rows=8),
    "dropless_once": MoEConfig(num_experts=E, d_ff=F, capacity_factor=0.0, block_rows=8, exchange_rows="device"),
}


def row_all_to_alls(found):
    """The all_to_alls that move token rows ([rows, D] float32); the once-per-device exchange
    adds one of [rows, 2k] (each row's gates and local expert ids)."""
    return [shape for kind, shape in found if kind == "all-to-all" and re.search(rf"f32\[[\d,]*,{D}\]", shape)]


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("mode", list(CONFIGS))
def test_forward_has_exactly_two_all_to_all_per_block(mode, mesh_shape):
    for num_blocks in (1, 2) if mesh_shape == (2, 4) else (1,):
        found = collectives(CONFIGS[mode], mesh_shape, num_blocks)
        extra = num_blocks if mode == "dropless_once" else 0
        assert [k for k, _ in found].count("all-to-all") == 2 * num_blocks + extra, found
        assert len(row_all_to_alls(found)) == 2 * num_blocks, found


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_expert_weights_are_never_all_gathered(mode):
    """Forward and backward: nothing is all-gathered, no weight and no activation; the dropless
    exchanges' counts come with the statistics' all-reduce."""
    for grad in (False, True):
        gathers = [shape for kind, shape in collectives(CONFIGS[mode], (2, 4), grad=grad) if "all-gather" in kind]
        assert gathers == [], gathers


# On data=2 x expert=4 a device's 16 tokens always fit one round of the once-per-device exchange
# (its chunks hold T rows), which then needs no counts at all.
@pytest.mark.parametrize("mode,mesh_shape", [(m, s) for m in CONFIGS for s in ((1, 8), (2, 4))
                                             if (m, s) != ("dropless_once", (2, 4))])
def test_the_forward_block_has_one_all_reduce_that_carries_the_dropless_counts(mode, mesh_shape, monkeypatch):
    """Besides its all_to_alls the forward block has one collective: the all-reduce of the routing
    statistics, which in dropless mode also brings what both sides of the exchange need, every
    device's counts (an [8, C] float32 matrix: rows per expert, or for the once-per-device exchange
    pairs per device); no all-gather, and on a data axis no max over it for the padded exchange's
    rounds. Past core.MERGED_COUNTS_LIMIT the exchange all-gathers the counts of its expert group
    (int32), and on a data axis the rounds take a max all-reduce (int32) as well."""
    others = lambda: [(kind, shape) for kind, shape in collectives(CONFIGS[mode], mesh_shape, with_aux=True)
                      if kind != "all-to-all"]
    found = others()
    assert [kind for kind, _ in found] == ["all-reduce"], found
    if mode != "capacity":
        counts = f"f32[8,{E if mode == 'dropless' else mesh_shape[1]}]"
        assert counts in found[0][1], found
        monkeypatch.setattr(core, "MERGED_COUNTS_LIMIT", 0)
        found = others()
        assert sorted(kind for kind, _ in found) == ["all-gather"] + ["all-reduce"] * (1 + (mesh_shape[0] > 1)), found
        assert counts not in " ".join(shape for _, shape in found), found


def test_ragged_exchange_lowers_to_two_ragged_all_to_all_per_block():
    """What TPU and GPU get in dropless mode; lowered only, as the CPU backend cannot compile it."""
    cfg = MoEConfig(num_experts=E, d_ff=F, capacity_factor=0.0, block_rows=8, exchange="ragged")
    m = mesh((2, 4))
    x, router, weights = sharded_inputs(m, 2)
    text = jax.jit(lambda x, w: stacked_blocks(x, router, w, cfg, m)).lower(x, weights).as_text()
    assert len(re.findall(r"ragged_all_to_all", text)) == 4
    assert len(re.findall(r"\ball_to_all", text)) == 0



def nbytes(shape: str) -> int:
    """Bytes of an HLO result shape (a tuple counts each element)."""
    sizes = {"f32": 4, "s32": 4, "bf16": 2}
    return sum(sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for t, dims in re.findall(r"(f32|s32|bf16)\[([\d,]*)\]", shape))


def exchange_bytes(cfg, tokens_per_device=128, d_model=128):
    """all_to_all bytes per device of one forward block on EP=8, along the path that balanced
    routing takes (one round of the padded exchange): (token row bytes, metadata bytes)."""
    m = mesh((1, 8))
    keys = jax.random.split(jax.random.key(0), 5)
    e, f = cfg.num_experts, cfg.d_ff
    put = lambda a, spec: jax.device_put(a, NamedSharding(m, spec))
    x = put(jax.random.normal(keys[0], (8, tokens_per_device, d_model)), P(("data", "expert")))
    router = put(jax.random.normal(keys[1], (d_model, e)), P())
    w = ExpertWeights(*(put(jax.random.normal(k, s), P("expert"))
                        for k, s in zip(keys[2:], [(e, d_model, f), (e, d_model, f), (e, f, d_model)], strict=True)))
    hlo = jax.jit(lambda x, w: moe_apply(x, router, w, cfg, m, train=True)[0]).lower(x, w).compile().as_text()
    smallest = lambda paths: min(paths, key=lambda p: sum(nbytes(s) for _, s in p))
    found = [s for kind, s in executed_collectives(hlo, pick=smallest) if kind == "all-to-all"]
    rows = [s for s in found if re.search(rf"f32\[[\d,]*,{d_model}\]", s)]
    return sum(map(nbytes, rows)), sum(map(nbytes, found)) - sum(map(nbytes, rows))


def expected_devices_per_token(cfg, num_tokens=4096):
    """Distinct devices (groups of 8 experts) per token of this routing, on random tokens."""
    from trainer.moe import routing

    logits = jax.random.normal(jax.random.key(3), (num_tokens, cfg.num_experts))
    experts, *_ = routing.top_k_routing(logits, cfg.top_k, score=cfg.score, expert_groups=cfg.expert_groups,
                                        groups_limit=cfg.routing_groups_limit, bias_E=jnp.zeros(cfg.num_experts))
    return float(jnp.mean(routing.distinct_groups(experts, cfg.num_experts // 8)))


@pytest.mark.parametrize("limit", [2, 4])
def test_once_per_device_exchange_moves_devices_per_token_over_k_of_the_bytes(limit):
    """E=64, k=8 in G=8 groups (one per device), at most M groups per token: the token rows the
    exchange moves shrink to (distinct devices per token) / k of one row per assignment; the
    metadata ([rows, 2k] float32) and the rounding of chunks to 8 rows are the padding."""
    base = dict(num_experts=64, top_k=8, d_ff=32, capacity_factor=0.0, score="sigmoid", expert_groups=8,
                routing_groups_limit=limit, block_rows=8)
    today, today_meta = exchange_bytes(MoEConfig(**base, exchange_rows="assignment"))
    once, meta = exchange_bytes(MoEConfig(**base, exchange_rows="device"))
    assert today_meta == 0 and meta > 0
    devices = expected_devices_per_token(MoEConfig(**base))
    assert limit - 0.1 < devices <= limit
    assert once <= (devices / 8) * today * 1.03, (once, today, devices)
    assert once + meta <= (devices / 8) * today * (1.03 + 2 * 8 / 128)
