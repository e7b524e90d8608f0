"""The slice lifecycle through the real google-cloud-tpu client against the emulator, per scenario."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import loaded_config

from provision.app import App
from provision.context import renderer_for
from provision.errors import QuotaError, StockoutError
from provision.kinds.tpu_vm.slices import managed_resources, slice_down, slice_status, slice_up

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "v5e-64.yaml"
CREATE = "google.cloud.tpu.v2.Tpu/CreateQueuedResource"


def make_config(tmp_path: Path, **changes):
    return loaded_config(EXAMPLE, tmp_path, **changes)


class Run:
    """One CLI invocation's worth of state: an App on the emulator in tmp_path."""

    def __init__(self, tmp_path: Path, scenario: str = "happy") -> None:
        self.app = App(dry_run=True, scenario=scenario, output="json", workdir=tmp_path)
        self.session = self.app.session()

    def creates(self) -> list[dict]:
        return [c for c in self.app.calls if c["rpc"] == CREATE]

    def close(self) -> None:
        self.app.close()


@pytest.fixture
def run_in(tmp_path):
    opened: list[Run] = []

    def open_run(scenario: str = "happy") -> Run:
        run = Run(tmp_path, scenario)
        opened.append(run)
        return run

    yield open_run
    for run in opened:
        run.close()


def test_happy_path_up_status_down(tmp_path, run_in):
    cfg = make_config(tmp_path)
    run = run_in()
    resources = slice_up(run.app.context(cfg))
    qr, *nodes = resources
    assert qr.kind == "queued_resource" and qr.state == "ACTIVE" and qr.zone == "us-west4-a"
    assert qr.name == "projects/my-project/locations/us-west4-a/queuedResources/" + qr.name.rsplit("/", 1)[-1]
    assert len(nodes) == 1 and nodes[0].state == "READY"
    assert len(nodes[0].workers) == 16  # v5litepod-64: 16 VMs of 4 chips, read from network_endpoints
    assert len(run.creates()) == 1
    body = run.creates()[0]["request"]["queued_resource"]["tpu"]["node_spec"][0]["node"]
    assert body["accelerator_type"] == "v5litepod-64"
    assert body["runtime_version"] == "v2-alpha-tpuv5-lite"
    assert body["labels"]["managed-by"] == "moe-tpu" and body["labels"]["moe-tpu-run"] == "moe-demo"
    assert "startup-script" in body["metadata"]
    kinds = sorted(r.kind for r in slice_status(run.app.context(cfg)))
    assert kinds == ["node", "queued_resource"]
    deleted = slice_down(run.app.context(cfg))
    assert [r.kind for r in deleted] == ["queued_resource"]
    assert managed_resources(run.session, "my-project", cfg.zones) == []


def test_state_persists_between_invocations(tmp_path, run_in):
    cfg = make_config(tmp_path)
    first = run_in()
    slice_up(first.app.context(cfg))
    first.close()
    second = run_in()
    states = {r.kind: r.state for r in slice_status(second.app.context(cfg))}
    assert states == {"queued_resource": "ACTIVE", "node": "READY"}


def test_stockout_falls_back_to_the_next_zone_and_cleans_up(tmp_path, run_in):
    cfg = make_config(tmp_path, region="us-east5", zones=["us-east5-a", "us-east5-b"])
    run = run_in("stockout")
    resources = slice_up(run.app.context(cfg))
    assert resources[0].zone == "us-east5-b" and resources[0].state == "ACTIVE"
    parents = [c["request"]["parent"] for c in run.creates()]
    assert parents == ["projects/my-project/locations/us-east5-a", "projects/my-project/locations/us-east5-b"]
    # The FAILED queued resource in the first zone was deleted: it would keep counting against quota.
    assert managed_resources(run.session, "my-project", ["us-east5-a"]) == []


def test_stockout_everywhere_fails_with_advice_and_leaves_nothing(tmp_path, run_in):
    cfg = make_config(tmp_path, zones=["us-west4-a"])  # `stockout` keeps the first zone out of capacity
    run = run_in("stockout")
    with pytest.raises(StockoutError) as info:
        slice_up(run.app.context(cfg))
    assert info.value.message == ("no capacity for 1 x v5litepod-64 (spot) in any zone tried: "
                                  "us-west4-a (no capacity)")
    assert "zones" in info.value.hint and "reservation" in info.value.hint
    assert info.value.exit_code == 1
    assert managed_resources(run.session, "my-project", cfg.zones) == []


def test_quota_fails_fast_and_names_the_quota(tmp_path, run_in):
    cfg = make_config(tmp_path)
    run = run_in("quota")
    with pytest.raises(QuotaError) as info:
        slice_up(run.app.context(cfg))
    assert "TPUV5sPreemptibleLitepodPerProjectPerZoneForTPUAPI" in info.value.message
    assert len(run.creates()) == 1  # a chip quota is not retried


def test_on_demand_quota_names_the_on_demand_quota(tmp_path, run_in):
    cfg = make_config(tmp_path, slice__capacity="on-demand")
    run = run_in("quota")
    with pytest.raises(QuotaError) as info:
        slice_up(run.app.context(cfg))
    assert "TPUV5sLitepodPerProjectPerZoneForTPUAPI" in info.value.message


def test_flaky_api_is_retried_and_makes_exactly_one_slice(tmp_path, run_in):
    cfg = make_config(tmp_path)
    run = run_in("flaky")
    resources = slice_up(run.app.context(cfg))
    assert resources[0].state == "ACTIVE"
    statuses = [c.get("status") for c in run.app.calls]
    assert "UNAVAILABLE" in statuses
    qrs = [r for r in managed_resources(run.session, "my-project", cfg.zones) if r.kind == "queued_resource"]
    assert len(qrs) == 1
    slice_down(run.app.context(cfg))
    assert managed_resources(run.session, "my-project", cfg.zones) == []


def crash_after_create(cfg, run_in) -> None:
    """An invocation that sent its create and died before waiting for anything."""
    from tests.control.render_calls import queued_resource_request

    crashed = run_in()
    request = queued_resource_request(cfg, "us-west4-a", renderer_for(cfg))
    crashed.session.tpu.client.create_queued_resource(request=request)
    crashed.close()


def test_rerun_after_a_crash_adopts_instead_of_duplicating(tmp_path, run_in):
    cfg = make_config(tmp_path)
    crash_after_create(cfg, run_in)
    rerun = run_in()
    resources = slice_up(rerun.app.context(cfg))
    assert resources[0].state == "ACTIVE"
    assert rerun.creates() == []  # adopted: no second create
    assert len([r for r in slice_status(rerun.app.context(cfg)) if r.kind == "queued_resource"]) == 1


def test_down_after_a_killed_up_leaves_nothing(tmp_path, run_in):
    cfg = make_config(tmp_path)
    crash_after_create(cfg, run_in)
    cleanup = run_in()
    deleted = slice_down(cleanup.app.context(cfg))
    assert len(deleted) == 1
    assert managed_resources(cleanup.session, "my-project", cfg.zones) == []


def test_long_queue_waits_hours_in_simulated_time(tmp_path, run_in):
    cfg = make_config(tmp_path, slice__max_wait="6h")
    run = run_in("long-queue")
    start = run.session.clock.now()
    resources = slice_up(run.app.context(cfg))
    assert resources[0].state == "ACTIVE"
    assert run.session.clock.now() - start > 2 * 3600
    polls = [c for c in run.app.calls if c["rpc"].endswith("GetQueuedResource")]
    assert len(polls) < 3 * 3600 / 60 + 20  # backed off to about a minute, not a tight loop


def test_long_queue_past_max_wait_moves_on_and_then_gives_up_with_a_hint(tmp_path, run_in):
    cfg = make_config(tmp_path, region="us-east5", zones=["us-east5-a", "us-east5-b"], slice__max_wait="30m")
    run = run_in("long-queue")
    with pytest.raises(StockoutError) as info:
        slice_up(run.app.context(cfg))
    assert info.value.message == (
        "no capacity for 1 x v5litepod-64 (spot) in any zone tried: "
        "us-east5-a (not provisioned within slice.max_wait (30m)), "
        "us-east5-b (not provisioned within slice.max_wait (30m))")
    assert "slice.max_wait" in info.value.hint
    assert managed_resources(run.session, "my-project", cfg.zones) == []


def test_preempted_spot_slice_is_seen_and_recreated(tmp_path, run_in):
    cfg = make_config(tmp_path)
    run = run_in("preempt")
    slice_up(run.app.context(cfg))
    run.session.clock.advance(3 * 3600)
    states = {r.kind: r.state for r in slice_status(run.app.context(cfg))}
    assert states.get("queued_resource") == "SUSPENDED"
    assert states.get("node") in (None, "PREEMPTED")
    # Recovery: a SUSPENDED queued resource cannot be reset; up deletes it and creates it again.
    resources = slice_up(run.app.context(cfg))
    assert resources[0].state == "ACTIVE"
    assert len(run.creates()) >= 2


def test_up_after_down_creates_a_fresh_slice(tmp_path, run_in):
    cfg = make_config(tmp_path)
    run = run_in()
    slice_up(run.app.context(cfg))
    slice_down(run.app.context(cfg))
    resources = slice_up(run.app.context(cfg))
    assert resources[0].state == "ACTIVE" and resources[1].state == "READY"


def test_multislice_waits_for_every_slice(tmp_path, run_in):
    cfg = make_config(tmp_path, slice__count=2)
    run = run_in()
    qr, *nodes = slice_up(run.app.context(cfg))
    assert qr.state == "ACTIVE"
    assert [n.state for n in nodes] == ["READY", "READY"]
    assert [len(n.workers) for n in nodes] == [16, 16]
    spec = run.creates()[0]["request"]["queued_resource"]["tpu"]["node_spec"][0]
    assert spec["multislice_params"]["node_count"] == 2
    slice_down(run.app.context(cfg))
    assert managed_resources(run.session, "my-project", cfg.zones) == []
