"""When training has diverged: the loss or the gradient norm no longer finite, or the loss finite but far
above what guessing every token uniformly costs (ln vocab_size nats): a model blown up by its learning rate
often stays finite for thousands of steps at losses of 10**5, and trained to the end saying "finished". The
loop checks both for every step, in order, where it reads the steps' metrics (a logged step, a checkpoint,
an evaluation, the end: never after anything of that step is saved), and stops with a message that names
the first bad step and the last good checkpoint (exit 1)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

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
        good = ckpt.latest_step() if ckpt is not None else None
        kept = (f"the last good checkpoint, step {good} in {ckpt.directory}, is kept" if good is not None else
                "no checkpoint was saved before it")
        super().__init__(f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped "
                         f"before saving anything of it ({kept}). Lower optim.lr (or raise optim.warmup_steps "
                         "or lower optim.clip_norm) and run again")
        self.step = step
