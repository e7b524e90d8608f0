"""Which layers the model scans together, and where each layer's parameters sit in the stacked layout.

The model compiles one block per repeating pattern of its layers and scans it (trainer/model.py), so that
compile time does not grow with depth. A *stack* is a run of layers that repeats one period of structures:
layers start, start + 1, ... start + period * repeats - 1, where layer start + j + period * r has the structure
of layer start + j (dense or MoE, full or sliding attention: ModelConfig.layer_kind). Its parameters are
stacked with a leading layer axis of length `repeats`: layer start + j + period * r is index r of
`stacks.{s}.{j}.<name in the block>`. DeepSeek's first dense layers then MoE are two stacks of period 1; a
dense/MoE alternation is one stack of period 2 (and so is GPT-OSS's sliding/full one); Qwen's mlp_only_layers
cut the runs where they fall.

A layer's own parameter names, `blocks.{i}.<name in the block>`, are those of the layout before stacking
(checkpoints of that layout still restore: `stack_flat` converts them) and those trainer/hf names its
tensors by (`locate` finds each one's place). Importing this module imports neither jax nor numpy.
"""

from __future__ import annotations

import dataclasses
import functools

LAYER_PREFIX = "blocks."  # a layer's own names: blocks.{i}.attn.wq
STACK_PREFIX = "stacks."  # the stacked layout's: stacks.{s}.{j}.attn.wq, leading axis the layer


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers start + j + period * r for j < period, r < repeats; one scanned step runs `period` layers."""

    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def layer(self, j: int, r: int) -> int:
        return self.start + j + self.period * r


def plan_stacks(kinds: tuple) -> tuple[Stack, ...]:
    """The stacks covering layers with these structures (one hashable kind a layer), chosen so that the
    fewest layers are compiled (the sum of the periods), then the fewest stacks: a dynamic programme over
    where the next stack starts (a model has tens of layers; this is instant)."""
    n = len(kinds)

    @functools.cache
    def best(start: int) -> tuple[tuple[int, int], tuple[Stack, ...]]:
        if start == n:
            return (0, 0), ()
        found = None
        for period in range(1, n - start + 1):
            repeats = 1
            while start + period * (repeats + 1) <= n and all(
                    kinds[start + period * repeats + j] == kinds[start + j] for j in range(period)):
                repeats += 1
            for r in range(repeats, 0, -1):  # a shorter run can leave a better start to the next stack
                (layers, count), rest = best(start + period * r)
                cost = (layers + period, count + 1)
                if found is None or cost < found[0]:
                    found = cost, (Stack(start, period, r), *rest)
        return found

    return best(0)[1]


def layer_stacks(model) -> tuple[Stack, ...]:
    """The stacks of a ModelConfig's layers (dense or MoE by its layer pattern, and their attention window)."""
    return _stacks_of(tuple(model.layer_kind(i) for i in range(model.num_layers)))


@functools.lru_cache(maxsize=64)
def _stacks_of(kinds: tuple) -> tuple[Stack, ...]:
    return plan_stacks(kinds)


def where(model, layer: int) -> tuple[int, int, int]:
    """(stack s, position j in its period, index r along its layer axis) of layer `layer`."""
    for s, stack in enumerate(layer_stacks(model)):
        if stack.start <= layer < stack.stop:
            r, j = divmod(layer - stack.start, stack.period)
            return s, j, r
    raise ValueError(f"layer {layer} is outside the model's {model.num_layers} layers")


def locate(model, name: str) -> tuple[str, int | None]:
    """(the stacked parameter's name, the layer's index along its leading axis) of a layer's own name
    `blocks.{i}.rest`; a name outside the layers (embed, head, final_norm) is its own, index None."""
    if not name.startswith(LAYER_PREFIX):
        return name, None
    layer, _, rest = name[len(LAYER_PREFIX):].partition(".")
    s, j, r = where(model, int(layer))
    return f"{STACK_PREFIX}{s}.{j}.{rest}", r


def layer_names(model, stacked: str) -> list[str]:
    """The layers' own names of a stacked parameter, in the order of its leading axis."""
    if not stacked.startswith(STACK_PREFIX):
        return [stacked]
    s, j, rest = stacked[len(STACK_PREFIX):].split(".", 2)
    stack = layer_stacks(model)[int(s)]
    return [f"{LAYER_PREFIX}{stack.layer(int(j), r)}.{rest}" for r in range(stack.repeats)]


def is_stacked(name: str) -> bool:
    return name.startswith(STACK_PREFIX)


def stack_flat(model, flat: dict, stack) -> dict:
    """A flat {name: array} of the per-layer layout (blocks.{i}.…) in the stacked one; `stack` is the array
    library's stack (numpy's or jax's). Names it does not hold are left out, for the caller to report."""
    out, groups = {}, {}
    for name, value in flat.items():
        stacked, index = locate(model, name)
        if index is None:
            out[name] = value
        else:
            groups.setdefault(stacked, {})[index] = value
    for stacked, parts in groups.items():
        if sorted(parts) == list(range(len(layer_names(model, stacked)))):
            out[stacked] = stack([parts[r] for r in range(len(parts))])
    return out


def unstack_flat(model, flat: dict) -> dict:
    """A flat {name: array} of the stacked layout as the per-layer one (each array sliced along its first axis)."""
    out = {}
    for name, value in flat.items():
        for r, layer_name in enumerate(layer_names(model, name)):
            out[layer_name] = value[r] if is_stacked(name) else value
    return out
