"""`moe-tpu serve` is trainer.serve's command under the moe-tpu name: its help imports no jax, and an
install without the serve extra is told which extra to install."""

import os
import subprocess
import sys

from cli_helpers import invoke


def run_without(module: str, args: list[str]) -> subprocess.CompletedProcess:
    """`moe-tpu ARGS` as in an install without `module` (None in sys.modules: it cannot be imported)."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['moe-tpu', *{args!r}]; "
            "from provision.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NO_COLOR="1"))


def test_serve_help_needs_no_jax_and_a_missing_server_package_names_the_extra(tmp_path):
    helped = run_without("jax", ["serve", "--help"])
    assert helped.returncode == 0, helped.stderr
    assert "--checkpoint DIR" in helped.stdout and "--kv-cache-dtype" in helped.stdout
    missing = run_without("fastapi", ["serve", "--checkpoint", str(tmp_path)])
    assert missing.returncode == 2 and "pip install 'moe-tpu[serve]'" in missing.stderr
    assert "Traceback" not in missing.stderr
    code, _, err = invoke("serve", "--checkpoint", str(tmp_path / "nothing"))
    assert code == 2 and f"--checkpoint {tmp_path / 'nothing'} does not exist" in err


def test_eval_is_the_trainers_evaluation_under_the_moe_tpu_name_and_names_its_extra(tmp_path):
    code, out, _ = invoke("eval", "--help")
    assert code == 0 and "--tasks" in out and "moe-tpu eval" in out
    missing = run_without("lm_eval", ["eval", "--checkpoint", str(tmp_path), "--tasks", "arc_easy"])
    assert missing.returncode == 2 and "pip install 'moe-tpu[eval]'" in missing.stderr
    assert "Traceback" not in missing.stderr
