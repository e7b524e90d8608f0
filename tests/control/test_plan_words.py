"""The planner's own words agree with its figures: for every example's target and every named trainer
config, on the plan's mesh and on each mesh one could give it, the verdict says FITS exactly when the
memory fits, and the advice never sends the user to the slice it just refused unless it names the mesh
that fits there (and that mesh does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from provision import catalogue, planner
from provision.config import load_config
from trainer.arith.params import inventory as param_inventory
from trainer.config import load_config as load_trainer_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
NAMED = sorted(p.stem for p in (ROOT / "trainer" / "configs").glob("*.yaml"))


def _targets() -> list[planner.Hardware]:
    found = {}
    for path in EXAMPLES:
        target = planner.target_of(load_config(path))
        found[(target.accelerator.name, target.slices)] = target
    return list(found.values())


def _check(plan: planner.Plan) -> None:
    line = planner.verdict_line(plan)
    target = plan.target
    assert line.startswith("FITS: " if plan.memory.total <= plan.memory.hbm else "DOES NOT FIT: "), line
    assert plan.fits == (plan.memory.total <= plan.memory.hbm)
    if plan.fits:
        return
    advice = planner.advice_text(plan.advice)
    assert advice in line
    smallest = re.search(r"smallest slice that fits: (\S+)", advice)
    if smallest:  # a slice that fits: never the one refused (one slice of the target's type) on another mesh
        acc = catalogue.accelerator(smallest.group(1).rstrip(";"))
        assert planner.fits_on(param_inventory(plan.model), plan.model, acc, 1)
        assert plan.advice.fitting_mesh is not None or (acc.name, 1) != (target.accelerator.name, target.slices)
    for count, name, mesh in re.findall(r"fits on (\d+) x (\S+?)( with --mesh \S+)?(?:;|$| \()", advice):
        if mesh:  # the target refused, with the mesh that fits on it: that mesh does fit
            given = planner.target_mesh(mesh.split()[-1], target.chips, target.slices)
            assert planner.memory_per_chip(param_inventory(plan.model), plan.model, given, target.accelerator).fits
        else:
            assert (int(count), name) != (target.slices, target.accelerator.name), line


@pytest.mark.parametrize("named", NAMED)
def test_every_verdict_and_advice_agrees_with_its_figures(named):
    model = load_trainer_config(named)
    params = param_inventory(model)
    # moe-1.2t fits no single target here: its advice searches every slice count (seconds a plan), so it
    # is read on its own example's target and mesh only.
    huge = named == "moe-1.2t"
    targets = [planner.target_of(load_config(ROOT / "examples" / "moe-1.2t.yaml"))] if huge else _targets()
    for target in targets:
        meshes = [None, *planner.mesh_options(model.moe.num_experts, model.model.num_moe_layers > 0,
                                              target.chips, target.slices)[:0 if huge else 3]]
        for mesh in meshes:
            _check(planner.make_plan(params, model, target, 10, mesh))


def test_a_given_mesh_that_does_not_fit_is_told_the_mesh_that_does_not_a_smaller_slice_that_is_the_same():
    model = load_trainer_config("v5e-64")
    target = planner.target_of(load_config(ROOT / "examples" / "v5e-64.yaml"))
    plan = planner.make_plan(param_inventory(model), model, target, 10, planner.Mesh(data=1, expert=64))
    line = planner.verdict_line(plan)
    assert line.startswith("DOES NOT FIT") and "smallest slice that fits: v5litepod-64" not in line
    assert f"fits on 1 x v5litepod-64 with --mesh {plan.advice.fitting_mesh.text()} (the plan's choice)" in line
    assert planner.verdict_of(plan).fitting_mesh == plan.advice.fitting_mesh.text()  # run's hint names it
