"""Every example runs from the command line for a few steps."""

import pytest

from ._helpers import run_example

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
    result = run_example(script, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss" in result.stdout
