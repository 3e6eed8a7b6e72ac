"""Long runs that survive: a job restarted after a rank fails, and a job preempted by
SIGTERM, each end with the parameters of an uninterrupted run, bit for bit.

Every run is `python -m eqxpar.launch -n 2 --devices-per-process 2
tests/_long_run_script.py` (the README's checkpoint loop with a PreemptionGuard);
the uninterrupted run is made once for the module. The runs share a JAX compilation
cache: each compiles the same few programs.
"""

import os
import pathlib
import re
import signal
import sys

import numpy as np
import pytest

from ._compile_flags import suite_xla_flags
from ._helpers import StreamedRun, assert_processes_gone
from ._long_run_script import FAULT_KINDS, fault_plan

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "_long_run_script.py"
PROCESSES = 2
STEPS, SAVE_EVERY = 40, 5  # the script's defaults


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    # The launcher adds each process's device count to the suite's compile flags.
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags()}
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def _launch(directory, *args, max_restarts=0):
    """The launcher command for one run whose files (checkpoints, pids, parameters) live in `directory`."""
    return [
        *(sys.executable, "-m", "eqxpar.launch", "-n", str(PROCESSES), "--devices-per-process", "2"),
        *("--timeout", "240", "--max-restarts", str(max_restarts), str(SCRIPT)),
        *("--ckpt-dir", str(directory / "ckpt"), "--pids-dir", str(directory), *args),
    ]


def _finish(directory, env, *, resumes_at=0):
    """Run the job in `directory` to its end, checking it starts at step `resumes_at`;
    return its final parameters."""
    run = StreamedRun(_launch(directory, "--params-out", str(directory / "params.npz")), env)
    assert run.wait() == 0, run.output[-4000:]
    assert f"[rank 0] restart 0: starting at step {resumes_at}" in run.output
    assert f"[rank 0] done at step {STEPS}" in run.output
    return dict(np.load(directory / "params.npz"))


@pytest.fixture(scope="module")
def uninterrupted(run_env, tmp_path_factory):
    return _finish(tmp_path_factory.mktemp("uninterrupted"), run_env)


def _assert_bit_identical(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _pids(directory):
    return [int(p.read_text()) for p in directory.glob("*.pid")]


def _restart_trial(seed, directory, env, want):
    rank, step, kind = fault_plan(seed, PROCESSES, STEPS)
    out = directory / "params.npz"
    run = StreamedRun(
        _launch(directory, "--fault-seed", str(seed), "--params-out", str(out), max_restarts=1), env
    )
    assert run.wait() == 0, run.output[-4000:]
    cause = {
        "raise": "exited with status 1",
        "exit3": "exited with status 3",
        "SIGKILL": "was killed by signal SIGKILL",
    }
    assert f"[rank {rank}] [rank {rank}/2] failing by {kind} after step {step}" in run.output
    (restart,) = [line for _, line in run.lines if line.startswith("eqxpar.launch: restart")]
    # The fault, and maybe its peer's failing a moment later (broken connections).
    assert restart.startswith("eqxpar.launch: restart 1 of 1: rank ")
    assert f"rank {rank} {cause[kind]}" in restart, run.output[-4000:]
    # Resumed from the latest complete checkpoint: the one of the fault's step may
    # have been cut short, the one before cannot have been.
    resumed = int(re.search(r"\[rank 0\] restart 1: starting at step (\d+)", run.output).group(1))
    assert step - 2 * SAVE_EVERY < resumed <= step and resumed % SAVE_EVERY == 0, (resumed, step)
    # The model and the data position both came back: any slip changes the parameters.
    _assert_bit_identical(dict(np.load(out)), want)
    pids = _pids(directory)
    assert len(pids) == 2 * PROCESSES  # each rank of each of the two runs
    assert_processes_gone(pids, f"a rank of trial {seed}")
    return kind


def test_a_job_restarted_after_a_rank_fails_ends_bit_identical(run_env, uninterrupted, tmp_path):
    assert _restart_trial(0, tmp_path, run_env, uninterrupted) == "exit3"


@pytest.mark.slow
def test_restarts_after_random_faults_end_bit_identical(run_env, uninterrupted, tmp_path):
    # Six seeded trials: each kind of fault, on either rank, at steps from 4 to 38.
    kinds = set()
    for seed in range(1, 7):
        (tmp_path / str(seed)).mkdir()
        kinds.add(_restart_trial(seed, tmp_path / str(seed), run_env, uninterrupted))
    assert kinds == set(FAULT_KINDS)


def _assert_saved_at_one_step(run, directory):
    """Every rank said it saved the same step, which is complete, the latest, and holds
    every process's shards; no process is left. Returns the step."""
    saved = dict(re.findall(r"\[rank (\d)\] \[rank \d/2\] stopping: saved step (\d+)", run.output))
    assert sorted(saved) == ["0", "1"] and len(set(saved.values())) == 1, run.output[-4000:]
    step = int(saved["0"])
    assert 3 <= step < STEPS
    complete = sorted(int(p.name) for p in (directory / "ckpt").iterdir() if p.name.isdigit())
    assert complete[-1] == step
    shards = directory / "ckpt" / str(step) / "state"
    assert sorted(p.name for p in shards.glob("ocdbt.process_*")) == ["ocdbt.process_0", "ocdbt.process_1"]
    assert_processes_gone(_pids(directory), "a preempted rank")
    return step


@pytest.mark.slow  # three 2-process runs: in make test-slow (CI runs it)
def test_sigterm_to_the_launcher_or_to_one_rank_saves_every_rank_at_one_step_and_reruns_resume(
    run_env, uninterrupted, tmp_path
):
    # One job, preempted twice (three runs, not four: each start costs seconds).
    # First SIGTERM to the launcher, which forwards it to both ranks.
    run = StreamedRun(_launch(tmp_path, "--step-delay", "0.05"), run_env)
    run.wait_for_line("[rank 0] step 3:")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM, run.output[-4000:]
    assert "eqxpar.launch: SIGTERM received: forwarded to the 2 running process(es)" in run.output
    assert "stopped by SIGTERM: rank 0 exited with status 0, rank 1 exited with status 0." in run.output
    first = _assert_saved_at_one_step(run, tmp_path)

    # The rerun resumes there; then SIGTERM to rank 1 alone, through JAX's
    # preemption service, stops both ranks at one step, and the launcher sees a
    # clean end.
    run = StreamedRun(_launch(tmp_path, "--step-delay", "0.05"), run_env)
    run.wait_for_line(f"[rank 0] step {first + 3}:")
    assert f"[rank 0] restart 0: starting at step {first}" in run.output
    os.kill(int((tmp_path / "0-1.pid").read_text()), signal.SIGTERM)
    assert run.wait() == 0, run.output[-4000:]
    assert "eqxpar.launch:" not in run.output  # neither a failure nor a restart
    second = _assert_saved_at_one_step(run, tmp_path)
    assert second > first + 3

    # The last rerun ends where the uninterrupted run ended, bit for bit.
    _assert_bit_identical(_finish(tmp_path, run_env, resumes_at=second), uninterrupted)
