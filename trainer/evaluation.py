"""Evaluation during training: the loss on held-out batches with the model in evaluation mode.

Evaluation mode routes with `moe.eval_capacity_factor` and no router noise. Every evaluation reads the
same `train.eval_batches` global batches (a fresh iterator from the start of the evaluation data), so
evaluations at different steps compare like with like. The figures join that step's metrics row:
`eval_loss` (mean cross-entropy, nats), `eval_perplexity` (exp of it) and `eval_drop_fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trainer import sharding
from trainer.model import cross_entropy, step_rngs
from trainer.sharding import global_batch


class Evaluator:
    def __init__(self, trainer, make_data: Callable, *, every: int, batches: int, total_steps: int):
        self.trainer, self.make_data = trainer, make_data
        self.every, self.batches, self.total_steps = every, batches, total_steps
        self._global_batch = global_batch
        graphdef, codec, rest = trainer.graphdef, trainer.codec, trainer.rest

        def eval_step(params: dict, tokens_BxT: jax.Array) -> dict[str, jax.Array]:
            model = nnx.merge(graphdef, codec.unflatten(params), step_rngs(rest, jnp.zeros((), jnp.int32)))
            logits_BxLxV, aux = model(tokens_BxT[:, :-1], train=False)
            return {"loss": cross_entropy(logits_BxLxV, tokens_BxT[:, 1:]), "drop_fraction": aux["drop_fraction"]}

        self._step = jax.jit(eval_step, in_shardings=(trainer.state_shardings["params"], trainer.batch_sharding),
                             out_shardings=sharding.replicated(trainer.mesh))

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.total_steps)

    def __call__(self, state: dict) -> dict[str, float]:
        data = self.make_data()
        losses, drops = [], []
        for _ in range(self.batches):
            out = jax.device_get(self._step(state["params"], self._global_batch(self.trainer, next(data))))
            losses.append(float(out["loss"]))
            drops.append(float(out["drop_fraction"]))
        loss = float(np.mean(losses))
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)),
                "eval_drop_fraction": float(np.mean(drops))}
