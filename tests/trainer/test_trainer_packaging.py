"""The trainer is what goes into the container: it must run without the control plane's dependencies."""

import subprocess
import sys
import textwrap

BLOCKED = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("provision", "grpc", "jinja2", "tenacity") or name.startswith("google.cloud"):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Block())
    import trainer.cli, trainer.train, trainer.model, trainer.data, trainer.checkpoint  # noqa: F401
    import trainer.datasets, trainer.prepare, trainer.sample, trainer.evaluation, trainer.tensorboard  # noqa: F401
    import trainer.plot  # noqa: F401
    import trainer.serve.cli, trainer.serve.startup, trainer.serve.server, trainer.serve.engine  # noqa: F401
    # (the bare google.cloud namespace may come from a .pth file at start-up; no client library does)
    assert not [m for m in sys.modules if m.startswith(("provision", "google.cloud.", "grpc"))]
    print("trainer imports alone")
""")


def test_trainer_imports_without_the_control_plane_or_google_cloud():
    res = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "trainer imports alone"


def test_test_code_stays_out_of_the_package():
    """The naive oracle and the emulated collective live in tests/; the MoE topology has no seam for them."""
    import dataclasses
    import importlib.util

    from trainer.moe.core import Topology

    assert importlib.util.find_spec("trainer.moe.oracle") is None
    assert [f.name for f in dataclasses.fields(Topology)] == \
        ["expert_axis", "num_expert_shards", "token_axes", "exchange", "grouped_matmul", "model_axis"]


WRITER_WITHOUT_TORCH = textwrap.dedent("""
    import sys, tempfile
    from trainer.tensorboard import TensorBoardWriter

    writer = TensorBoardWriter(tempfile.mkdtemp())
    writer.write({"step": 1, "loss": 2.5})
    writer.close()
    assert "torch" not in sys.modules and "google.cloud.storage" not in sys.modules, "imported what it never uses"
    import torch  # noqa: F401 - both still importable after
    from google.cloud import storage  # noqa: F401
    print("neither")
""")


def test_the_tensorboard_writer_leaves_torch_and_cloud_storage_unimported_and_importable():
    """tensorboardX would import both where installed (torch is, here, for the oracles): 1.5 s of every
    trainer's start."""
    res = subprocess.run([sys.executable, "-c", WRITER_WITHOUT_TORCH], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "neither"
