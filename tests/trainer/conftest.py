"""Runs that several test modules assert on, trained once per test session."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """`tiny` trained 120 steps on one device through the command line, as a user runs it: its output
    directory (checkpoint at step 120, config.json), its metric rows and what it printed. Read it, never
    write into it: the tests that share it run in any order."""
    from trainer.cli import train_command

    tmp = tmp_path_factory.mktemp("trained-tiny")
    out, metrics = tmp / "run", tmp / "m.jsonl"
    result = CliRunner().invoke(train_command, ["--config", "tiny", "--devices", "1", "--steps", "120",
                                                "--output-dir", str(out), "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 121))
    return SimpleNamespace(output_dir=out, rows=rows, output=result.output)
