"""The planner's on-disk cache of the trainer's parameter inventory and shard counts
(provision/planner/params_cache.py): a later command asks no jax for what an earlier one asked, and gets
what the trainer's own code answers; a damaged cache file is ignored and replaced; "off" keeps nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from provision.planner import params_cache
from trainer.config import load_config
from trainer.params import param_inventory, shard_ways

ROOT = Path(__file__).resolve().parents[2]
# A command's planning, in a fresh process: the plan of examples/v5e-64.yaml (its inventory and every
# shard count its meshes ask), then whether jax was started, and the inventory's first rows.
PLAN = """
import json, sys
from provision.config import load_config
from provision.planner.plan import plan_for
from provision.planner.params_cache import param_inventory, shard_ways
from trainer.config import load_config as trainer_config
plan = plan_for(load_config(sys.argv[1]))
params = param_inventory(trainer_config("tiny"))
print(json.dumps({"jax": "jax" in sys.modules, "mesh": plan.mesh.text(),
                  "tiny": [[p.name, list(p.shape), p.dtype, list(p.axes)] for p in params],
                  "ways": shard_ways(("expert", "embed", "mlp"), (8, 64, 128), (("data", 2), ("expert", 4)), True)}))
"""


def _plan(cache: Path | str) -> dict:
    env = {**os.environ, params_cache.CACHE_ENV: str(cache)}
    out = subprocess.run([sys.executable, "-c", PLAN, str(ROOT / "examples" / "v5e-64.yaml")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_later_command_asks_jax_nothing_and_gets_the_trainers_answers(tmp_path):
    first, second = _plan(tmp_path), _plan(tmp_path)
    assert first["jax"] is True and second["jax"] is False
    assert first == {**second, "jax": True}
    tiny = [[p.name, list(p.shape), p.dtype, list(p.axes)] for p in param_inventory(load_config("tiny"))]
    assert second["tiny"] == tiny
    assert second["ways"] == shard_ways(("expert", "embed", "mlp"), (8, 64, 128), (("data", 2), ("expert", 4)),
                                        True)
    [kept] = tmp_path.glob("params-*.json")
    assert kept.name == f"params-{params_cache.source_digest()}.json"


def test_a_damaged_cache_file_is_ignored_and_replaced(tmp_path):
    path = tmp_path / "params-x.json"
    good = {"format": params_cache.FORMAT, "models": {"m": [["w", [2, 3], "float32", ["embed", None]]]},
            "ways": {"k": 4}}
    for damage in ("{not json", "[]", json.dumps({**good, "format": 0}), json.dumps({**good, "ways": []}),
                   "x" * (params_cache.MAX_BYTES + 1)):
        path.write_text(damage)
        store = params_cache._Store(path)
        assert (store.models, store.ways) == ({}, {}), damage[:40]
        store.ways["k"], store.added = 2, True
        store.save()
        assert json.loads(path.read_text()) == {"format": params_cache.FORMAT, "models": {}, "ways": {"k": 2}}
    path.write_text(json.dumps({**good, "ways": {"k": 4, "bad": -1, "worse": "2"}}))
    assert params_cache._Store(path).ways == {"k": 4}  # what this does not write is dropped


def test_off_keeps_nothing(tmp_path):
    store = params_cache._Store(None)  # what cache_dir() gives for "off"
    store.ways["k"], store.added = 2, True
    store.save()
    assert list(tmp_path.rglob("*")) == []
    assert params_cache.cache_dir({params_cache.CACHE_ENV: "off", "XDG_CACHE_HOME": str(tmp_path)}) is None
    assert params_cache.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/moe-tpu/plan")
    assert params_cache.cache_dir({params_cache.CACHE_ENV: "/y"}) == Path("/y")
