"""When training has diverged: the loss or the gradient norm no longer finite, or the loss finite but far
above what guessing every token uniformly costs (ln vocab_size nats): a model blown up by its learning rate
often stays finite for thousands of steps at losses of 10**5, and trained to the end saying "finished". The
loop checks both for every step, in order, where it reads the steps' metrics (a logged step, a checkpoint,
an evaluation, the end: never after anything of that step is saved), and stops with a message that names
the first bad step and the last good checkpoint (exit 1).

A finite loss does not make a finite state: a parameter that no token reaches (an embedding row of a token the
data never holds, an expert nobody routes to) gets a zero gradient, and an update of 0/0 (optim.eps 0) makes it
NaN while the loss stays finite for as long as nothing reads it. So before every save the state itself is
checked (`check_state`): a checkpoint of non-finite values is never written, and never rotates a good one out."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from trainer.checkpoint import Checkpointer


# A loss this many times a uniform guess's is no training, whatever the step: a fresh model starts near
# ln(vocab_size) and only goes down from there. The floor keeps a vocabulary of a few tokens from a
# ceiling that the first steps' noise could cross.
UNIFORM_MULTIPLE = 4.0
CEILING_FLOOR = 8.0


def loss_ceiling(vocab_size: int) -> float:
    """The cross-entropy (nats) past which a finite loss is divergence."""
    return max(UNIFORM_MULTIPLE * math.log(vocab_size), CEILING_FLOOR)


class Diverged(RuntimeError):
    """The loss or the gradient norm stopped being finite, or the loss passed `ceiling`; the message names
    the step and the last good checkpoint (exit 1). Nothing of that step is saved."""

    def __init__(self, step: int, metrics: dict, ckpt: Checkpointer | None, ceiling: float | None = None):
        loss, grad_norm = float(metrics["total_loss"]), float(metrics["grad_norm"])
        if ceiling is not None and math.isfinite(loss) and math.isfinite(grad_norm):
            loss = (f"{float(metrics['loss']):,.4g} nats, over {ceiling:.1f} ({UNIFORM_MULTIPLE:g} times the "
                    "loss of guessing every token uniformly, ln(model.vocab_size))")
        super().__init__(f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped "
                         f"before saving anything of it ({_kept(ckpt)}). Lower optim.lr (or raise optim.warmup_steps "
                         "or lower optim.clip_norm) and run again")
        self.step = step


class NonFiniteState(Diverged):
    """The state to be saved holds a NaN or an infinity although its step's loss and gradient norm were
    finite; nothing of it is saved (exit 1)."""

    def __init__(self, step: int, names: list[str], ckpt: Checkpointer | None):
        more = len(names) - MAX_NAMES
        shown = ", ".join(names[:MAX_NAMES]) + (f" and {more} more" if more > 0 else "")
        RuntimeError.__init__(self, f"training diverged at step {step}: its loss and gradient norm are finite, but "
                                    f"the parameters or optimizer state after it hold NaN or infinite values "
                                    f"({shown}); stopped before saving them ({_kept(ckpt)}). Lower optim.lr (or "
                                    "raise optim.eps if it is 0: an update of a zero gradient is then 0/0) and run "
                                    "again")
        self.step = step


MAX_NAMES = 5  # arrays named in the message; the rest counted


def _kept(ckpt: Checkpointer | None) -> str:
    good = ckpt.latest_step() if ckpt is not None else None
    return (f"the last good checkpoint, step {good} in {ckpt.directory}, is kept" if good is not None else
            "no checkpoint was saved before it")


def check_state(step: int, state, ckpt: Checkpointer | None) -> None:
    """NonFiniteState unless every floating-point array of `state` is finite. One reduction per array in one
    program, read once: the cost of a save is the writing, not this."""
    names, arrays = [], []
    for path, value in jax.tree_util.tree_leaves_with_path(state):
        if jnp.issubdtype(value.dtype, jnp.inexact):
            names.append(jax.tree_util.keystr(path, simple=True, separator="."))
            arrays.append(value)
    if not arrays:
        return
    finite = np.asarray(_all_finite(_replicated(arrays[0]))(arrays))
    bad = [name for name, ok in zip(names, finite, strict=True) if not ok]
    if bad:
        raise NonFiniteState(step, bad, ckpt)


@functools.cache
def _all_finite(out_sharding):
    def flags(arrays):
        return jnp.stack([jnp.isfinite(a).all() for a in arrays])

    return jax.jit(flags) if out_sharding is None else jax.jit(flags, out_shardings=out_sharding)


def _replicated(array):
    """The sharding that leaves the flags on every device (each process reads them), where the state has a mesh."""
    from jax.sharding import NamedSharding, PartitionSpec

    where = getattr(array, "sharding", None)
    return NamedSharding(where.mesh, PartitionSpec()) if isinstance(where, NamedSharding) else None
