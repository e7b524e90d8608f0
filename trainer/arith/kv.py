"""The positions of a sequence each layer attends over and its KV cache holds: every one for full attention,
at most `model.sliding_window` for a sliding layer (its cache a ring of that many positions a slot). The
training FLOP count (counts.py) and the planner's KV cache bytes and decode reads take them from here."""

from __future__ import annotations


def layer_positions(model, layer: int, length: int) -> int:
    """The positions layer `layer` of a ModelConfig attends over, and a cache of it holds, in a sequence of
    `length`: all of them, or a sliding layer's window where that is shorter."""
    window = model.window(layer)
    return min(window, length) if window else length


def slot_positions(model, length: int) -> int:
    """Every layer's positions of one slot of `length` together (num_layers x length without sliding layers)."""
    return sum(layer_positions(model, i, length) for i in range(model.num_layers))
