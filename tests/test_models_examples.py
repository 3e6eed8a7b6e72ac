"""The demo (examples/demo.py) runs from the command line for a few steps on a
tiny GPT: the default plan (pipe x data x tensor, 1F1B), and the data x fsdp x
tensor plan without a pipeline (automatic). (Each run
costs a process and four compilations: the manual and overlapped tensor-parallel
plans are covered by tests/test_models.py instead.)"""

from ._helpers import run_example

TINY = [
    "--steps",
    "2",
    "--eval-every",
    "1",
    "--batch-size",
    "8",
    "--seq-len",
    "16",
    "--d-model",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--layers",
    "2",
    "--d-hidden",
    "64",
    "--sample-len",
    "20",
]


def run_demo(args, out):
    return run_example("demo.py", [*TINY, "--out", str(out), *args])


def test_demo_runs_default_plan(tmp_path):
    result = run_demo([], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "mesh data 2 x pipe 2 x tensor 2; mode manual (pipeline), pipeline 1f1b x 4 micro-batches\n" in out
    assert "step 2: loss" in out
    assert "final eval loss" in out and "unigram entropy" in out
    assert "sample:\nPython " in out
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert (tmp_path / "sample.txt").read_text().startswith("Python ")


def test_demo_without_pipeline(tmp_path):
    result = run_demo(["--pipe", "1", "--fsdp", "2"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh data 2 x fsdp 2 x tensor 2; mode auto\n" in result.stdout
    assert "final eval loss" in result.stdout
