"""When training has diverged: the loss or the gradient norm no longer finite. The loop checks it after every
step, before anything of that step is saved, and stops with a message that names the step and the last good
checkpoint (exit 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.checkpoint import Checkpointer


class Diverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the message names the step and the last good
    checkpoint (exit 1). Nothing of that step is saved."""

    def __init__(self, step: int, metrics: dict, ckpt: Checkpointer | None):
        loss, grad_norm = float(metrics["total_loss"]), float(metrics["grad_norm"])
        good = ckpt.latest_step() if ckpt is not None else None
        kept = (f"the last good checkpoint, step {good} in {ckpt.directory}, is kept" if good is not None else
                "no checkpoint was saved before it")
        super().__init__(f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped "
                         f"before saving anything of it ({kept}). Lower optim.lr (or raise optim.warmup_steps "
                         "or lower optim.clip_norm) and run again")
        self.step = step
