"""The positions of a sequence each layer attends over and its KV cache holds: every one for full attention,
at most `model.sliding_window` for a sliding layer (its cache a ring of that many positions a slot), and the
devices a latent-attention cache splits its positions over. The training FLOP count (counts.py) and the
planner's KV cache bytes and decode reads take them from here."""

from __future__ import annotations

PREFIX_BLOCK = 16  # the prefix cache's tokens a block (trainer/serve/prefix.py; vLLM's default block size)


def layer_positions(model, layer: int, length: int) -> int:
    """The positions layer `layer` of a ModelConfig attends over, and a cache of it holds, in a sequence of
    `length`: all of them, or a sliding layer's window where that is shorter."""
    window = model.window(layer)
    return min(window, length) if window else length


def slot_positions(model, length: int) -> int:
    """Every layer's positions of one slot of `length` together (num_layers x length without sliding layers)."""
    return sum(layer_positions(model, i, length) for i in range(model.num_layers))


def latent_split_ways(model: int, max_len: int) -> int:
    """The devices of a `model` axis of this size that latent attention's serving cache splits its positions
    over (trainer/serve/latentcache.py): all of them where they divide max_len and the prefix cache's block
    (its blocks of positions are laid out as the cache is), else none (every device holding every position:
    padding max_len to a multiple would give the cache positions past max_len, where the writes of idle slots
    and of a last chunk's padding, dropped today, would land)."""
    return model if max_len % model == 0 and PREFIX_BLOCK % model == 0 else 1
