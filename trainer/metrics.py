"""The one object that prints: JSON-lines metrics (a file or stdout) and a progress line on stderr.

Only the writer process (jax.process_index() == 0) prints anything; the others stay silent.
"""

from __future__ import annotations

import json
import math
import sys
from typing import IO, Any


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null, numpy scalars and arrays become Python values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class Reporter:
    def __init__(self, metrics_path: str | None = None, *, is_writer: bool = True,
                 stderr: IO[str] | None = None, stdout: IO[str] | None = None):
        self.is_writer = is_writer
        self.err = stderr or sys.stderr
        self._own = None
        if not is_writer:
            self.out = None
        elif metrics_path:
            self._own = self.out = open(metrics_path, "a", buffering=1)
        else:
            self.out = stdout or sys.stdout

    def metrics(self, row: dict[str, Any]) -> None:
        if self.out is None:
            return
        self.out.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self.out.flush()

    def progress(self, row: dict[str, Any], total_steps: int) -> None:
        if not self.is_writer:
            return
        parts = [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.4f}"]
        if row.get("entropy_floor") is not None:
            parts.append(f"floor {row['entropy_floor']:.4f}")
        parts += [f"aux {row['aux_loss']:.4f}", f"drop {row['drop_fraction']:.3f}",
                  f"{row['tokens_per_s']:,.0f} tok/s", f"{row['step_time_s'] * 1e3:.1f} ms/step"]
        if row.get("mfu") is not None:
            parts.append(f"mfu {row['mfu']:.1%}")
        self.info("  ".join(parts))

    def info(self, message: str) -> None:
        if self.is_writer:
            print(message, file=self.err, flush=True)

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None
