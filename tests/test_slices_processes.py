"""A two-slice HSDP plan over two CPU processes (each process one slice, as
`make_mesh(dcn=...)` counts them): data parallel across the processes, FSDP over each
one's 4 devices. It trains like one device, and its checkpoint, written by both
processes, restores under this one process.
"""

import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np

import eqxpar
import eqxpar.checkpoint

from ._compile_flags import suite_xla_flags
from ._helpers import assert_params_close, assert_trees_close, reference_run
from ._multihost_script import HSDP_STEPS, hsdp_problem

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_hsdp_across_two_processes_trains_like_one_device_and_restores_in_one(tmp_path):
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags()}
    command = [sys.executable, "-m", "eqxpar.launch", "-n", "2", "--devices-per-process", "4"]
    command += ["--timeout", "240", str(ROOT / "tests" / "_multihost_script.py"), "hsdp", str(tmp_path)]
    run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    # The data axis pairs a device of each process; fsdp's groups are one process's devices.
    assert '[rank 0] groups by process: {"data": [0, 1], "fsdp": [0, 0, 0, 0]}' in run.stdout
    assert "[rank 0] [rank 0/2] feeds rows slice(0, 16, None)" in run.stderr
    assert "[rank 1] [rank 1/2] feeds rows slice(16, 32, None)" in run.stderr

    model, optimizer, loss, batches = hsdp_problem()
    losses, reference = reference_run(model, optimizer, loss, batches)
    two = json.loads((tmp_path / "losses.json").read_text())
    assert len(two) == HSDP_STEPS
    assert_trees_close(two, losses)
    trained = dict(np.load(tmp_path / "params.npz"))
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(reference, eqx.is_inexact_array))[0]
    expected = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}
    assert sorted(trained) == sorted(expected)
    assert_params_close(trained, expected)

    # Restored in this one process, on a mesh of another shape: the very arrays
    # the two processes ended with.
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=256))
    like = eqx.filter_eval_shape(eqxpar.train.init, model, optimizer, plan, key=jax.random.key(1))
    with eqxpar.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        state, _ = manager.restore(like=like, plan=plan)
    assert int(state.step) == HSDP_STEPS
    restored = jax.tree_util.tree_flatten_with_path(eqx.filter(state.model, eqx.is_inexact_array))[0]
    for path, leaf in restored:
        np.testing.assert_array_equal(np.asarray(leaf), trained[jax.tree_util.keystr(path)])
