"""The pipeline examples run from the command line for a couple of steps."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
TINY = ["--steps", "2", "--batch-size", "16", "--seq-len", "8", "--d-model", "16", "--heads", "2"]

CASES = [
    ("pipeline_parallel.py", ["--schedule", "1f1b", "--microbatches", "4", "--layers", "4", *TINY]),
    ("hybrid_3d.py", ["--schedule", "zero_bubble", "--microbatches", "2", "--layers", "2", *TINY]),
]


@pytest.mark.parametrize("script,args", CASES, ids=[" ".join([s, *a[:4]]) for s, a in CASES])
def test_pipeline_example_runs(script, args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets its own
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final eval loss" in result.stdout
    assert "bubble" in result.stdout
