"""Log-probabilities from the engine's own forward passes: the prompt's (prefill logits, for `echo`) and
each generated token's, in float32, with the best `TOP` alternatives of each position.

They are computed inside the jitted steps, under a `lax.cond` on whether any row asked, so a step in which
no request wants them costs what it did without (the branch not taken is not run), and nothing compiles
again when one does. The values are those of the model's distribution (log-softmax of its logits), before
temperature, top-k or top-p shape the draw, as OpenAI's and vLLM's are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TOP = 20  # the most alternatives a request may ask for (OpenAI's limit for `logprobs` and `top_logprobs`)


def token_logprobs(logits_NxV: jax.Array, targets_N: jax.Array, want: jax.Array):
    """(logprob of targets_N[n] at row n [N], the TOP best logprobs [N, TOP], their token ids [N, TOP]);
    zeros where `want` (a traced bool) is false."""
    rows, vocab = logits_NxV.shape
    top = min(TOP, vocab)

    def compute(logits_NxV, targets_N):
        logsm_NxV = jax.nn.log_softmax(logits_NxV.astype(jnp.float32), axis=-1)
        chosen_N = jnp.take_along_axis(logsm_NxV, targets_N[:, None], axis=-1)[:, 0]
        best_NxK, ids_NxK = jax.lax.top_k(logsm_NxV, top)
        return chosen_N, best_NxK, ids_NxK.astype(jnp.int32)

    def skip(logits_NxV, targets_N):
        return (jnp.zeros(rows, jnp.float32), jnp.zeros((rows, top), jnp.float32),
                jnp.zeros((rows, top), jnp.int32))

    return jax.lax.cond(want, compute, skip, logits_NxV, targets_N)


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One position's: the token there, its logprob, and the `top` best (ids and logprobs, best first)."""

    token: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def records(tokens, chosen_N, best_NxK, ids_NxK, top: int) -> list[Logprob]:
    """Host-side records of the first len(tokens) rows of a step's outputs, keeping `top` alternatives."""
    chosen, best, ids = np.asarray(chosen_N), np.asarray(best_NxK), np.asarray(ids_NxK)
    return [Logprob(int(t), float(chosen[n]), tuple(int(i) for i in ids[n, :top]),
                    tuple(float(v) for v in best[n, :top])) for n, t in enumerate(tokens)]
