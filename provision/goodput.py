"""Goodput: where a run's wall time went, from its timeline and the trainer's metrics rows.

    productive    the step times of the steps that count (each step's last run)
    lost          the step times of steps run again after a preemption (progress lost)
    restore       the trainer's checkpoint restores (`restore_s` in the first row after a resume)
    startup       the rest of each attempt, from the slice or job being up to its end: start-up,
                  compilation, checkpoint saves, evaluation
    provisioning  everything outside the attempts: creating, queueing, recreating after a preemption

The shares are of the sum of the five, which is the run's wall time up to the last event; a part that
clock skew would make negative counts as zero.
"""

from __future__ import annotations

from typing import Any

ATTEMPT_START = ("provisioned", "recovered")
ATTEMPT_END = ("finished", "preempted", "failed")
PARTS = ("productive", "lost", "restore", "startup", "provisioning")


def step_seconds(rows: list[dict]) -> list[tuple[int, int, float]]:
    """(step, steps the row covers, seconds) per metrics row: a row's step time is per step since the row
    before it, or since the step its process started from (`start_step` in its first row)."""
    out: list[tuple[int, int, float]] = []
    previous = 0
    for row in rows:
        step, per_step = row.get("step"), row.get("step_time_s")
        if not isinstance(step, int) or not isinstance(per_step, (int, float)):
            continue
        if isinstance(row.get("start_step"), int):
            previous = row["start_step"]
        covered = step - previous if step > previous else 1
        out.append((step, covered, covered * float(per_step)))
        previous = step
    return out


def compute(events: list[dict[str, Any]], rows: list[dict]) -> dict[str, Any] | None:
    """{"wall_s", "seconds": {part: s}, "shares_pct": {part: %}, "lost_steps"}; None without a timeline."""
    if not events:
        return None
    wall = float(events[-1]["elapsed_s"])
    in_attempts, opened = 0.0, None
    for event in events:
        if event["event"] in ATTEMPT_START and opened is None:
            opened = float(event["elapsed_s"])
        elif event["event"] in ATTEMPT_END and opened is not None:
            in_attempts += float(event["elapsed_s"]) - opened
            opened = None
    if opened is not None:
        in_attempts += wall - opened
    counted = step_seconds(rows)
    last_index = {step: i for i, (step, _, _) in enumerate(counted)}
    productive = sum(s for i, (step, _, s) in enumerate(counted) if last_index[step] == i)
    lost = sum(s for i, (step, _, s) in enumerate(counted) if last_index[step] != i)
    lost_steps = sum(n for i, (step, n, _) in enumerate(counted) if last_index[step] != i)
    restore = sum(float(r["restore_s"]) for r in rows if isinstance(r.get("restore_s"), (int, float)))
    seconds = {"productive": productive, "lost": lost, "restore": restore,
               "startup": max(0.0, in_attempts - productive - lost - restore),
               "provisioning": max(0.0, wall - in_attempts)}
    total = sum(seconds.values()) or 1.0
    return {"wall_s": round(wall, 1), "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "shares_pct": {k: round(100.0 * v / total, 2) for k, v in seconds.items()}, "lost_steps": lost_steps}


def summary_line(result: dict[str, Any]) -> str:
    shares = result["shares_pct"]
    rest = ", ".join(f"{name} {shares[name]:.1f}%" for name in PARTS[1:])
    return (f"goodput: {shares['productive']:.1f}% of {result['wall_s']:.0f}s productive; {rest}; "
            f"{result['lost_steps']} step(s) lost to preemption")
