"""The `--mesh` text (`data=D,expert=E`), read once for the trainer, the planner and the config checks.

Imports nothing but the standard library: the control plane reads a config's mesh with it before any
jax is loaded; trainer/sharding.py builds the device mesh from the shape it returns.
"""

from __future__ import annotations

MESH_AXES = ("data", "expert")


def mesh_axes(text: str) -> dict[str, int]:
    """`data=D,expert=E` (either may be left out) -> the axes given. Raises ValueError naming the mistake."""
    given: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in MESH_AXES:
            raise ValueError(f"--mesh expects data=D,expert=E; got '{text}'")
        if key in given:
            raise ValueError(f"--mesh names '{key}' twice")
        try:
            given[key] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {key} must be an integer, got '{value}'") from None
        if given[key] < 1:
            raise ValueError(f"--mesh {key} must be at least 1")
    return given


def filled(given: dict[str, int], devices: int) -> tuple[int, int]:
    """(data, expert) of the given axes on `devices`: expert defaults to 1, data to every device left."""
    expert = given.get("expert", 1)
    return given.get("data", devices // expert), expert


def parse_mesh(text: str | None, num_devices: int) -> dict[str, int]:
    """`data=D,expert=E` -> {"data": D, "expert": E}; default all devices on data. Raises ValueError."""
    data, expert = filled(mesh_axes(text), num_devices) if text else (num_devices, 1)
    if data * expert != num_devices:
        raise ValueError(f"--mesh data={data},expert={expert} needs {data * expert} devices, "
                         f"but there are {num_devices}")
    return {"data": data, "expert": expert}


def mesh_size(text: str | None) -> int | None:
    """The device count a `--mesh` asks for; None when it leaves data to fill the devices."""
    given = mesh_axes(text) if text else {}
    return given["data"] * given.get("expert", 1) if "data" in given else None
