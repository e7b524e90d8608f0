"""Two trainer processes on CPU (jax.distributed over 127.0.0.1): process 0 alone writes metrics and
TensorBoard events; every checkpoint keeps each host's data position."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from trainer.cli import set_fake_devices

DRIVER = textwrap.dedent("""
    import os, sys
    import jax
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    os.environ["MOE_TRAIN_DISTRIBUTED"] = "0"  # initialised above, as a cluster would
    from trainer.cli import main
    main(sys.argv[3:], prog_name="moe-train")
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_write_events_from_process_0_only_and_save_both_hosts_positions(tmp_path):
    (np.arange(20000) % 256).astype(np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    set_fake_devices(1, env)  # one CPU device each, the suite's XLA flags kept (tests/conftest.py)
    args = ["--config", "tiny", "--steps", "4", "--set", "data.source=tokens", "--set", f"data.path={tmp_path}/t.bin",
            "--set", "train.checkpoint_every=2", "--output-dir", str(out)]
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), address, str(i), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "step 4/4" in outputs[0] and "step 4/4" not in outputs[1]  # only process 0 prints

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    events = list((out / "tensorboard").iterdir())
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, pytest.approx(e.value, abs=1e-6)) for e in acc.Scalars("learning/loss")] == \
        [(r["step"], r["loss"]) for r in rows]

    data = json.loads((out / "checkpoints" / "4" / "data" / "metadata").read_text())  # orbax's JSON item
    assert data["process_count"] == 2 and len(data["hosts"]) == 2
    assert all(len(json.dumps(h)) < 1024 for h in data["hosts"])
