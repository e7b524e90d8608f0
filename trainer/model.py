"""The decoder-only MoE language model: embedding, pre-norm blocks (attention + dense or MoE FFN), head."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from trainer import attention, initializers, loss, sharding
from trainer.arith.params import LAYERS_AXIS  # the stacked parameters' leading axis (trainer/sharding.py)
from trainer.config import Config
from trainer.layers import Attention, DenseFFN, RMSNorm, lecun, named_param
from trainer.mla import MLAttention
from trainer.moe import MoEBlock
from trainer.moe import core as moe_core
from trainer.moe.direct import layer_product
from trainer.moe.stacked import split_stacks, with_layer
from trainer.stacks import Stack, layer_stacks


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then + ffn(norm(x)), the FFN dense or MoE (the
    config's layer pattern). The same wiring trains (no cache) and decodes (a key/value cache)."""

    def __init__(self, cfg: Config, layer: int, *, mesh: Mesh | None, rngs: nnx.Rngs):
        m, dtype, pdtype = cfg.model, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        if m.mla is not None:  # multi-head latent attention (DeepSeek)
            self.attn = MLAttention(m.d_model, m.num_heads, m.mla, rope_theta=m.rope_theta, dtype=dtype,
                                    param_dtype=pdtype, rngs=rngs, attention=m.attention)
        else:
            self.attn = Attention(m.d_model, m.num_heads, m.kv_heads, m.head_size, rope_theta=m.rope_theta,
                                  dtype=dtype, param_dtype=pdtype, rngs=rngs, bias=m.qkv_bias, qk_norm=m.qk_norm,
                                  norm_eps=m.norm_eps, attention=m.attention, out_bias=m.out_bias,
                                  sinks=m.attention_sinks, window=m.window(layer), yarn=m.yarn)
        self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.is_moe = m.is_moe_layer(layer)
        if self.is_moe:
            self.ffn = MoEBlock(cfg.moe, m.d_model, mesh=mesh, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        else:
            self.ffn = DenseFFN(m.d_model, m.d_ff, dtype=dtype, param_dtype=pdtype, rngs=rngs,
                                products=cfg.moe.direct_products, layer_product=layer_product)

    def __call__(self, x_BxLxD: jax.Array, *, train: bool, cache=None) -> tuple[jax.Array, dict | None, object]:
        """(the block's output, the MoE layer's aux or None, the updated cache or None). With `cache`
        (trainer.serve.kvcache.LayerCache) the tokens attend through it and MoE routes one token a row."""
        attended = self.attn(self.attn_norm(x_BxLxD), cache=cache)
        attn_BxLxD, cache = attended if cache is not None else (attended, None)
        x_BxLxD = x_BxLxD + attn_BxLxD
        h_BxLxD = self.ffn_norm(x_BxLxD)
        aux = None
        if not self.is_moe:
            y_BxLxD = self.ffn(h_BxLxD)
        elif cache is None:
            y_BxLxD, aux = self.ffn(h_BxLxD, train=train)
        else:  # one token a row: the MoE block splits rows over the mesh's token shards
            batch, length, d_model = h_BxLxD.shape
            y_BxLxD = self.ffn(h_BxLxD.reshape(batch * length, 1, d_model), train=False)[0]
            y_BxLxD = y_BxLxD.reshape(batch, length, d_model)
        return x_BxLxD + y_BxLxD.astype(x_BxLxD.dtype), aux, cache

    def decode(self, x_BxLxD: jax.Array, cache) -> tuple[jax.Array, object]:
        """The block at inference over a key/value cache (trainer.serve.kvcache.LayerCache)."""
        x_BxLxD, _, cache = self(x_BxLxD, train=False, cache=cache)
        return x_BxLxD, cache

    def decode_groups(self, xs: tuple, kv, view) -> tuple[tuple, object]:
        """The block at inference over groups of tokens that attend apart, each through its own view of the
        whole cache `kv` (`view(kv, g)`: group g's LayerCache, made after the groups before it wrote theirs),
        and go through the FFN together: a prefill chunk and a decode step in one program read the FFN's and
        the experts' weights once. Returns (each group's output, the cache). One group: `decode`."""
        if len(xs) == 1:
            x_BxLxD, layer = self.decode(xs[0], view(kv, 0))
            return (x_BxLxD,), layer.cache
        attended = []
        for g, x_BxLxD in enumerate(xs):
            attn_BxLxD, layer = self.attn(self.attn_norm(x_BxLxD), cache=view(kv, g))
            kv = layer.cache
            attended.append(x_BxLxD + attn_BxLxD)
        d_model = attended[0].shape[-1]
        x_TxD = jnp.concatenate([x.reshape(-1, d_model) for x in attended])
        h_Tx1xD = self.ffn_norm(x_TxD)[:, None]  # one token a row, as decoding routes them
        y_Tx1xD = self.ffn(h_Tx1xD) if not self.is_moe else self.ffn(h_Tx1xD, train=False)[0]
        x_TxD = x_TxD + y_Tx1xD[:, 0].astype(x_TxD.dtype)
        return _split_rows(x_TxD, [x.shape for x in attended]), kv


class Transformer(nnx.Module):
    """`model(tokens_BxL, train=...) -> (logits_BxLxV float32, aux)`; aux sums/averages the MoE layers'.

    The layers are held as stacks (trainer/stacks.py): `stacks[s][j]` is one Block whose variables carry a
    leading axis over the layers start + j + period * r of stack s, and one step of a `jax.lax.scan` runs a
    period of them, so that a model compiles one block per pattern whatever its depth. `model.scan_layers:
    false` runs the same stacked parameters a layer at a time in Python (each layer traced apart: the
    reference the scan is tested against)."""

    def __init__(self, cfg: Config, *, mesh: Mesh | None = None, rngs: nnx.Rngs, layers_together: bool = True):
        m, pdtype = cfg.model, jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.mesh = mesh
        self.remat = m.remat
        self.remat_policy = REMAT_POLICIES[m.remat_policy]
        self.scan_layers = m.scan_layers
        self.decode_layers = m.decode_layers
        self.num_experts = cfg.moe.num_experts
        self.vocab = sharding.vocab_axis(cfg.train.shard_vocab)
        self.embed = named_param(rngs, initializers.normal(1.0), (m.vocab_size, m.d_model),
                                 (self.vocab, "embed"), pdtype)
        self.layout = layer_stacks(m)
        self.windows = tuple(m.window(i) for i in range(m.num_layers))  # each layer's sliding window (0: none)
        self.stacks = nnx.List([nnx.List([_stacked_block(cfg, stack, j, mesh, rngs, layers_together)
                                            for j in range(stack.period)])
                                for stack in self.layout])
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, dtype=self.dtype, param_dtype=pdtype, rngs=rngs)
        self.tied_scale = m.d_model ** -0.5 if m.tied_head_scale else 1.0
        self.head = None if m.tie_embeddings else named_param(
            rngs, lecun, (m.d_model, m.vocab_size), ("embed", self.vocab), pdtype)

    def __call__(self, tokens_BxL: jax.Array, *, train: bool = True) -> tuple[jax.Array, dict]:
        x_BxLxD, aux = self.features(tokens_BxL, train=train)
        with sharding.logical_mesh(self.mesh):
            return self._logits(x_BxLxD), aux

    def features(self, tokens_BxL: jax.Array, *, train: bool = True) -> tuple[jax.Array, dict]:
        """The last layer's output [B, L, D] (before the final norm and the head) and the MoE aux."""
        with sharding.logical_mesh(self.mesh):  # where the layers' `sharding.constrain` lays activations out
            x_BxLxD = self._constrain(self._embedded(tokens_BxL).astype(self.dtype))
            auxes = []
            for s in range(len(self.layout)):
                x_BxLxD, _, stack_auxes = self._run_stack(s, x_BxLxD, train=train)
                auxes += stack_auxes
            return x_BxLxD, combine_aux(sorted(auxes, key=lambda a: a[0]), self.num_experts)

    def cross_entropy(self, x_BxLxD: jax.Array, targets_BxL: jax.Array, chunk: int = 0) -> jax.Array:
        """Mean next-token cross-entropy (float32) of the logits of `features`' output. With `chunk` (a
        divisor of L below it) the positions go chunk by chunk, each chunk's float32 logits made again in the
        backward pass: peak memory holds one chunk's logits, not all of them (moe-1b's batch of 16 x 1,024
        over 32,768 tokens: 2 GiB each for the logits, their softmax and its gradient)."""
        batch, length, width = x_BxLxD.shape
        with sharding.logical_mesh(self.mesh):
            w_DxV = self._head_weight()
            if w_DxV is None:  # an int4 head (serving's evaluation): its own contraction, through autodiff
                return cross_entropy(self._logits(x_BxLxD), targets_BxL)

            def chunk_sum(x_BxKxD, t_BxK):  # trainer/loss.py: the backward pass makes the logits again
                return loss.nll_sum(self.final_norm(x_BxKxD), w_DxV, t_BxK, self.mesh, self.vocab)

            if not chunk or chunk >= length or length % chunk:
                return chunk_sum(x_BxLxD, targets_BxL) / (batch * length)
            x_CxBxKxD = x_BxLxD.reshape(batch, length // chunk, chunk, width).swapaxes(0, 1)
            t_CxBxK = targets_BxL.reshape(batch, length // chunk, chunk).swapaxes(0, 1)
            total, _ = jax.lax.scan(lambda acc, xt: (acc + chunk_sum(*xt), None), jnp.zeros((), jnp.float32),
                                    (x_CxBxKxD, t_CxBxK))
            return total / (batch * length)

    def decode(self, tokens_BxL: jax.Array, cache, starts_B: jax.Array, rows_B: jax.Array | None = None,
               span: int | None = None, lengths_B: jax.Array | None = None):
        """Inference through a key/value cache (trainer.serve.kvcache.KVCache, or another of
        trainer/serve/latentcache.py's CacheLayout): batch row b holds tokens at positions starts_B[b].. of
        cache slot rows_B[b] (None: slot b), the first lengths_B[b] of them real, the rest padding (None: all
        real), attending over the first `span` positions of the slots (a static length past every token's
        position; None: all). The same blocks as training; MoE layers in their evaluation mode. Returns
        (logits_BxLxV float32, the updated cache)."""
        (logits_BxLxV,), cache = self.decode_groups([(tokens_BxL, starts_B, rows_B, lengths_B)], cache, span)
        return logits_BxLxV, cache

    def decode_groups(self, groups: list[tuple], cache,
                      span: int | None | tuple[int | None, ...] = None) -> tuple[list[jax.Array], object]:
        """`decode` of several groups of tokens in one pass, each group (tokens_BxL, starts_B, rows_B,
        lengths_B) as `decode` takes them, into other slots of the cache than the others': each layer attends
        group by group, in order, and runs its FFN and the head over all their tokens at once (Block's
        decode_groups), so that a prefill chunk fused with a decode step reads the weights once. `span`: the
        positions every group attends over, or a tuple of each group's (a decode step's rows then read their
        own span of the cache, not a long prompt's). Returns (each group's logits [B, L, V] float32, the
        updated cache)."""
        spans = tuple(span) if isinstance(span, tuple | list) else (span,) * len(groups)
        if len(spans) != len(groups):
            raise ValueError(f"{len(spans)} spans for {len(groups)} groups")
        with sharding.logical_mesh(self.mesh):  # tensor parallelism's activation layouts, as in training
            xs = tuple(self._embedded(tokens_BxL).astype(self.dtype) for tokens_BxL, *_ in groups)
            views = [(*rest, spans[g]) for g, (_, *rest) in enumerate(groups)]
            for s in range(len(self.layout)):
                xs, cache, _ = self._run_stack(s, xs, train=False, cache=(cache, views))
            if len(xs) == 1:
                return [self._logits(xs[0])], cache
            d_model = xs[0].shape[-1]
            logits_1xTxV = self._logits(jnp.concatenate([x.reshape(1, -1, d_model) for x in xs], axis=1))
            return list(_split_rows(logits_1xTxV[0], [x.shape[:2] for x in xs])), cache

    def _run_stack(self, s: int, x_BxLxD, *, train: bool, cache=None):
        """Stack s's layers over x: (x after them, the updated cache or None, [(layer, its MoE aux)]).
        Decoding (`cache`: the cache, each group's (starts_B, rows_B, lengths_B, span)), x is a tuple of
        the groups' activations (Transformer.decode_groups).

        One step runs a period of layers on that step's slice of the stacked parameters (and, decoding, on
        the whole cache, each layer through its own view: trainer.serve.kvcache.KVCache.layer). What the
        blocks change (the MoE balancing biases, the jitter streams' counts) comes out stacked and is put
        back into the stack's blocks."""
        stack, blocks = self.layout[s], self.stacks[s]
        graphdef, params, state = nnx.split(blocks, nnx.Param, ...)
        layers_RxP = jnp.asarray([[stack.layer(j, r) for j in range(stack.period)] for r in range(stack.repeats)],
                                 jnp.int32)
        kv, views = cache if cache is not None else (None,) * 2
        # Decoding, the routed experts' weights stay whole and each layer reads them through its index
        # (trainer/moe/stacked.py: a grouped-matmul kernel then fetches only the experts the tokens route to)
        params, whole = split_stacks(params, stack.repeats) if kv is not None else (params, {})

        def step(carry, xs):
            x, kv = carry
            layer_params, layer_state, layers_P, r = xs
            period = nnx.merge(graphdef, with_layer(layer_params, whole, r) if whole else layer_params, layer_state)
            auxes = []
            for j, block in enumerate(period):
                if kv is not None:
                    window = self.windows[stack.layer(j, 0)]

                    def view(kv, g, index=layers_P[j], window=window):
                        starts_B, rows_B, lengths_B, span = views[g]
                        return kv.layer(index, starts_B, rows_B, span, lengths_B=lengths_B, window=window)

                    x, kv = block.decode_groups(x, kv, view)
                    continue
                if self.remat:
                    x, aux, _ = nnx.remat(lambda blk, h: blk(h, train=train), policy=self.remat_policy)(block, x)
                else:
                    x, aux, _ = block(x, train=train)
                x = self._constrain(x)
                auxes.append(aux)
            return (x, kv), (nnx.state(period, nnx.Not(nnx.Param)), auxes)

        xs = (params, state, layers_RxP, jnp.arange(stack.repeats, dtype=jnp.int32))
        if self._scans(x_BxLxD if kv is not None else None):
            (x_BxLxD, kv), (state, auxes) = jax.lax.scan(step, (x_BxLxD, kv), xs)
        else:  # the reference: the same step a layer at a time, its outputs stacked as the scan stacks them
            outs = []
            for r in range(stack.repeats):
                (x_BxLxD, kv), out = step((x_BxLxD, kv), jax.tree.map(lambda a, r=r: a[r], xs))
                outs.append(out)
            state, auxes = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        nnx.update(blocks, state)
        layer_auxes = [(stack.layer(j, r), jax.tree.map(lambda a, r=r: a[r], aux))
                       for j, aux in enumerate(auxes) if aux is not None for r in range(stack.repeats)]
        return x_BxLxD, kv, layer_auxes

    def _scans(self, groups: tuple | None) -> bool:
        """Whether _run_stack scans over the layers: as scan_layers says, but for a lone stream's decode step
        (`groups`, the activations of a pass through the cache: every row one token, one row a device that
        splits the tokens) run unrolled where decode_layers says. Unrolled, a step of more rows had XLA copy
        whole attention stacks into the vector memory instead (compiled for a v5e chip, moe-1b at 8 rows: 107
        MB written against 23 scanned, benchmarks/serve_aot.py), and bf16's steps at 8 and 32 slots came out
        4-6% slower on the chip; at one row it copies nothing more."""
        decoding = groups is not None and all(x.shape[1] == 1 for x in groups)
        splits = 1 if self.mesh is None else self.mesh.shape.get("data", 1) * self.mesh.shape.get("expert", 1)
        if not decoding or sum(x.shape[0] for x in groups) > splits or self.decode_layers == "scan":
            return self.scan_layers
        if self.decode_layers == "unrolled":
            return False
        device = self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]
        return self.scan_layers and device.platform == "cpu"

    def layers(self) -> list[Block]:
        """Each layer's Block in order, with its own slice of the stacked variables (copies: what a call
        changes in them stays there), for tests and tools that walk the model a layer at a time."""
        out = {}
        for stack, blocks in zip(self.layout, self.stacks, strict=True):
            graphdef, state = nnx.split(blocks)
            for r in range(stack.repeats):
                period = nnx.merge(graphdef, jax.tree.map(lambda a, r=r: a[r], state))
                out.update({stack.layer(j, r): block for j, block in enumerate(period)})
        return [out[i] for i in sorted(out)]

    def _embedded(self, tokens_BxL: jax.Array) -> jax.Array:
        """The tokens' rows of the embedding (of a quantized one, trainer/serve/quant.py, only those rows widened)."""
        return self.embed.get_value().take(tokens_BxL, axis=0)

    def _head_weight(self) -> jax.Array | None:
        """The head's [D, V] weight in the compute dtype (the tied embedding's transpose, scaled); None for an
        int4 head, which contracts group by group (trainer/serve/quant4.py) and is never widened."""
        if hasattr((self.embed if self.head is None else self.head).get_value(), "contract"):
            return None
        if self.head is None:  # tied: by default scaled so that unit-variance embeddings give unit-variance logits
            w_DxV = self.embed[...].T if self.tied_scale == 1.0 else self.embed[...].T * self.tied_scale
        else:
            w_DxV = self.head[...]
        return w_DxV.astype(self.dtype)

    def _logits(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = self.final_norm(x_BxLxD)
        w_DxV = self._head_weight()
        if w_DxV is None:
            logits_BxLxV = (self.embed if self.head is None else self.head).get_value().contract(x_BxLxD, self.dtype)
            if self.head is None and self.tied_scale != 1.0:
                logits_BxLxV = logits_BxLxV * self.tied_scale
        else:
            logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV, preferred_element_type=jnp.float32)
        if self.vocab == "vocab":  # whole: XLA lays the logits out as their batch
            return logits_BxLxV
        return sharding.constrain(logits_BxLxV, ("batch", "length", self.vocab))

    def _constrain(self, x_BxLxD: jax.Array) -> jax.Array:
        spec = sharding.activation_spec(self.mesh)
        return x_BxLxD if spec is None else jax.lax.with_sharding_constraint(x_BxLxD, spec)


def _split_rows(x_TxN, shapes) -> tuple:
    """x's leading rows cut in turn into arrays of `shapes` (whose leading axes' sizes multiply to the rows
    each takes), the trailing axes kept."""
    out, at = [], 0
    for shape in shapes:
        rows = shape[0] * shape[1]
        out.append(x_TxN[at:at + rows].reshape(*shape[:2], *x_TxN.shape[1:]))
        at += rows
    return tuple(out)


# Each MoE layer's own balance, reported per layer as "moe.{layer}.{name}" (float32 scalars).
LAYER_METRICS = ("load_max_over_mean", "load_min_over_mean", "load_cv", "drop_fraction", "groups_per_token")


# model.remat_policy -> what a rematerialised block keeps from its forward pass (jax.checkpoint_policies).
REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_saveable,
                  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "attention": jax.checkpoint_policies.save_only_these_names(*attention.SAVED),
                  "attention_ffn": jax.checkpoint_policies.save_only_these_names(*attention.SAVED, *DenseFFN.SAVED),
                  "attention_moe": jax.checkpoint_policies.save_only_these_names(*attention.SAVED, *moe_core.SAVED)}


def combine_aux(layer_auxes: list[tuple[int, dict]], num_experts: int) -> dict[str, jax.Array]:
    """Losses add up over the MoE layers; drop fraction and expert load are averaged over them; the
    balance metrics of each layer (LAYER_METRICS) are kept per layer, keyed by its block index."""
    if not layer_auxes:
        zero = jnp.zeros((), jnp.float32)
        return {"aux_loss": zero, "z_loss": zero, "drop_fraction": zero,
                "expert_load": jnp.zeros((num_experts,), jnp.float32)}
    auxes = [aux for _, aux in layer_auxes]
    per_layer = {f"moe.{i}.{name}": jnp.asarray(aux[name], jnp.float32)
                 for i, aux in layer_auxes for name in LAYER_METRICS}
    return {
        **per_layer,
        "aux_loss": sum(jnp.asarray(a["aux_loss"], jnp.float32) for a in auxes),
        "z_loss": sum(jnp.asarray(a["z_loss"], jnp.float32) for a in auxes),
        "drop_fraction": jnp.mean(jnp.stack([jnp.asarray(a["drop_fraction"], jnp.float32) for a in auxes])),
        "expert_load": jnp.mean(jnp.stack([jnp.asarray(a["expert_load"], jnp.float32) for a in auxes]), 0),
    }


def _stacked_block(cfg: Config, stack: Stack, j: int, mesh: Mesh | None, rngs: nnx.Rngs,
                   together: bool = True) -> Block:
    """The Block of layers stack.layer(j, r), r < stack.repeats (all of one structure), its variables stacked
    along a new leading axis, named "layers" for the sharding rules (never split).

    `together`: the layers are made by one loop (jax.lax.map) whose body builds one Block, each turn drawing
    the keys that layer's Block drew in a row of them, so the values are the same to the bit; the program holds
    one Block's initialisation whatever the depth, and writes each layer into its slice of the stacked arrays
    (moe-1b in bfloat16, its state's initialisation on a CPU: XLA's compile 25.5 -> 11.6 s, temporaries 7.4 ->
    2.1 GiB). Otherwise (and for an `rngs` that is not one plain stream) a layer at a time, stacked after."""
    stream = _only_stream(rngs)
    if together and stream is not None and stack.repeats > 1:
        return _stacked_together(cfg, stack, j, mesh, stream)
    blocks = [Block(cfg, stack.layer(j, r), mesh=mesh, rngs=rngs) for r in range(stack.repeats)]
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.state(block) for block in blocks]
    return nnx.merge(graphdef, jax.tree.map(_stacked, *states, is_leaf=_is_var))


_is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731


def _stacked(*variables: nnx.Variable) -> nnx.Variable:
    """One variable of the layers, their values stacked."""
    return _named_stacked(variables[0], jnp.stack([v.get_value() for v in variables]))


def _named_stacked(variable: nnx.Variable, value_RxN: jax.Array) -> nnx.Variable:
    """`variable` with the layers' values, its leading axis named for the sharding rules."""
    names = sharding.variable_names(variable)
    if names is None:
        return variable.replace(value_RxN)
    return variable.replace(value_RxN, out_sharding=(LAYERS_AXIS, *names))


def _only_stream(rngs) -> nnx.RngStream | None:
    """The one stream of an nnx.Rngs(seed) (the trainer's and the server's), else None."""
    if not isinstance(rngs, nnx.Rngs):
        return None
    streams = [v for v in vars(rngs).values() if isinstance(v, nnx.RngStream)]
    return streams[0] if len(streams) == 1 and streams[0] is getattr(rngs, "default", None) else None


class _CountingRngs:
    """Counts the keys a Block's construction draws (under eval_shape: nothing computed)."""

    def __init__(self):
        self.draws = 0

    def params(self):
        self.draws += 1
        return jax.random.key(0)

    default = params

    def fork(self):
        self.draws += 1
        return self


def _stacked_together(cfg: Config, stack: Stack, j: int, mesh: Mesh | None, stream: nnx.RngStream) -> Block:
    counter = _CountingRngs()
    with initializers.shapes_only():
        nnx.eval_shape(lambda: Block(cfg, stack.layer(j, 0), mesh=mesh, rngs=counter))
    per_layer = counter.draws
    key, first = stream.key[...], stream.count[...]
    made = {}

    def layer(r):  # layer r's construction, its stream where the r-th Block in a row would find it
        rngs = nnx.Rngs(default=key)
        rngs.default.count[...] = first + r * per_layer
        block = Block(cfg, stack.layer(j, 0), mesh=mesh, rngs=rngs)
        made["graphdef"], state = nnx.split(block)
        return state

    states = jax.lax.map(layer, jnp.arange(stack.repeats, dtype=jnp.uint32))
    stream.count[...] = first + stack.repeats * per_layer
    named = jax.tree.map(lambda v: _named_stacked(v, v.get_value()), states, is_leaf=_is_var)
    return nnx.merge(made["graphdef"], named)


def abstract_split(make_model: Callable[[], Transformer]) -> tuple:
    """(graphdef, abstract params, abstract MoE biases, non-parameter state) of the model `make_model()` builds:
    the shapes from an abstract build, the rest (RNG streams; the step folds into their keys) made by one
    program. No random draw is traced for either (initializers.shapes_only)."""
    from trainer.moe.layer import ExpertBias

    with initializers.shapes_only():
        graphdef, params, biases, _ = nnx.split(nnx.eval_shape(make_model), nnx.Param, ExpertBias, ...)
        rest = jax.jit(lambda: nnx.split(make_model(), nnx.Param, ExpertBias, ...)[3])()
    return graphdef, params, biases, rest


def build_model(cfg: Config, *, mesh: Mesh | None = None, seed: int = 0) -> Transformer:
    """Builds the model eagerly and unsharded (tests, small runs); train.init_state does it sharded."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed))


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats, in float32."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1))


def _path_name(path) -> str:
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
        parts.append(str(name))
    return ".".join(parts)


class ParamCodec:
    """Converts an nnx.State of Params to a flat {"stacks.0.1.attn.wq": array} dict and back.

    Flat string-keyed dicts are what the optimizer, the checkpoints and the sharding specs see; the
    codec keeps the nnx tree structure (and the Params' metadata) to rebuild the model inside jit.
    """

    def __init__(self, params: nnx.State):
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)
        self.variables = {_path_name(path): var for path, var in with_path}
        self.names = list(self.variables)
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        if len(leaves) != len(self.names):
            raise ValueError("every Param must hold exactly one array")

    def flatten(self, params: nnx.State) -> dict[str, jax.Array]:
        return dict(zip(self.names, jax.tree_util.tree_leaves(params), strict=True))

    def unflatten(self, flat: dict[str, jax.Array]) -> nnx.State:
        return jax.tree_util.tree_unflatten(self.treedef, [flat[n] for n in self.names])


def step_rngs(rest: nnx.State, step: jax.Array) -> nnx.State:
    """RNG streams with the step folded into their keys: fresh noise every step, the same on resume."""

    def fold(var):  # new Variables: nnx mutates them (the count), which needs this trace's objects
        if isinstance(var, nnx.RngKey):
            fold_in = lambda key: jax.random.fold_in(key, step)  # noqa: E731
            for _ in range(var[...].ndim):  # a stacked stream: one key a layer
                fold_in = jax.vmap(fold_in)
            return var.replace(fold_in(var[...]))
        return var.replace(var[...])

    return jax.tree.map(fold, rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
