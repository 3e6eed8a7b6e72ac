"""The pipeline examples run from the command line for a couple of steps."""

import pytest

from ._helpers import run_example

TINY = ["--steps", "2", "--batch-size", "16", "--seq-len", "8", "--d-model", "16", "--heads", "2"]

CASES = [
    ("pipeline_parallel.py", ["--schedule", "1f1b", "--microbatches", "4", "--layers", "4", *TINY]),
    ("hybrid_3d.py", ["--schedule", "zero_bubble", "--fsdp", "--microbatches", "2", "--layers", "2", *TINY]),
]


@pytest.mark.parametrize("script,args", CASES, ids=[" ".join([s, *a[:4]]) for s, a in CASES])
def test_pipeline_example_runs(script, args):
    result = run_example(script, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final eval loss" in result.stdout
    assert "bubble" in result.stdout
