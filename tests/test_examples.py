"""Every example runs from the command line for a few steps."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent

CASES = [
    ("data_parallel.py", ["--steps", "3", "--batch-size", "64"]),
    ("data_parallel.py", ["--steps", "3", "--batch-size", "64", "--mode", "manual", "--accumulate", "2"]),
    ("filter_jit_loop.py", ["--steps", "3"]),
    *[
        (
            "tensor_parallel.py",
            [
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--seq-len",
                "16",
                "--d-model",
                "32",
                "--layers",
                "1",
                "--mode",
                mode,
            ],
        )
        for mode in ["auto", "sync", "sp", "overlap", "partial"]
    ],
]


@pytest.mark.parametrize("script,args", CASES, ids=[" ".join([s, *a]) for s, a in CASES])
def test_example_runs(script, args):
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
    assert "loss" in result.stdout
