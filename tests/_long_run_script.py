"""A long run that survives (run as a script by tests/test_long_runs.py; not a test).

The checkpoint loop of README.md / docs/guides/checkpoints.md, made to survive:
it resumes from the latest complete checkpoint and its data position whenever
one exists, and saves and stops at a step every process agrees on when the job
gets SIGTERM (`eqxpar.distributed.PreemptionGuard`).

    python -m eqxpar.launch -n 2 --devices-per-process 2 --max-restarts 1 \\
        tests/_long_run_script.py --ckpt-dir DIR [--steps N] [--save-every K]
        [--fault-seed S] [--step-delay SECONDS] [--pids-dir DIR] [--params-out FILE]

--fault-seed S: on the job's first run (restart_count() == 0) one process, picked
    with the seed as `fault_plan` says, fails after a step by an exception,
    `sys.exit(3)` or SIGKILL; the launcher restarts the job, which resumes.
--pids-dir DIR: each process writes its pid to DIR/<restart>-<rank>.pid.

    python tests/_long_run_script.py --measure-async-save [--width 1024]

runs alone (8 simulated devices) and prints the median time of a train step with
an asynchronous checkpoint save in flight, of one without, and their ratio.
"""

import os
import sys

# Alone, simulate 8 devices; the launcher gives each process its own count.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

FAULT_KINDS = ("raise", "exit3", "SIGKILL")


def fault_plan(seed: int, processes: int, steps: int) -> tuple[int, int, str]:
    """`(rank, step, kind)`: which process fails, after which step, and how."""
    rng = np.random.default_rng(seed)
    return int(rng.integers(processes)), int(rng.integers(1, steps + 1)), str(rng.choice(FAULT_KINDS))


def _fail(kind: str, step: int) -> None:
    import eqxpar.distributed as dist

    dist.log(f"failing by {kind} after step {step}")
    if kind == "raise":
        raise RuntimeError(f"injected fault after step {step}")
    if kind == "exit3":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--fault-seed", type=int, default=None)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--pids-dir", default=None)
    parser.add_argument("--params-out", default=None, help="process 0 writes the final parameters (.npz)")
    parser.add_argument("--measure-async-save", action="store_true")
    parser.add_argument("--repeats", type=int, default=20, help="steps timed per case (--measure-async-save)")
    return parser.parse_args(argv)


def _setup(width: int):
    """The README loop's model, data, plan, state, step and iterator."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqxpar
    import eqxpar.data

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    rng = np.random.default_rng(0)  # every process builds the same data
    x = rng.normal(size=(512, 16)).astype(np.float32)
    y = np.tanh(x[:, :4])
    key = jax.random.key(0)
    model, optim = eqx.nn.MLP(16, 4, width, 2, key=key), optax.adamw(1e-2)
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=-1), rules=eqxpar.rules.FSDP(min_size=256))
    state = eqxpar.train.init(model, optim, plan, key=key)
    step = eqxpar.train.make_step(loss_fn, optim, plan)
    batches = eqxpar.data.ShardedIterator((x, y), plan, batch_size=64, seed=0)
    return plan, state, step, batches


def train(args: argparse.Namespace) -> None:
    import eqxpar.distributed as dist

    # The preemption service lets every process agree on the step to stop at.
    dist.initialize(preemption_service=True)
    import equinox as eqx
    import jax
    from jax.experimental import multihost_utils

    import eqxpar.checkpoint
    import eqxpar.data

    restart = dist.restart_count()
    if args.pids_dir:
        path = pathlib.Path(args.pids_dir) / f"{restart}-{dist.process_index()}.pid"
        path.write_text(str(os.getpid()))
    plan, state, step, batches = _setup(args.width)
    fault = None
    if args.fault_seed is not None and restart == 0:
        fault = fault_plan(args.fault_seed, dist.process_count(), args.steps)
    guard = dist.PreemptionGuard()
    manager = eqxpar.checkpoint.CheckpointManager(args.ckpt_dir, max_to_keep=3)
    if manager.latest_step() is not None:
        state, data_state = manager.restore(like=state, plan=plan)
        batches.set_state(data_state)
    dist.print_once(f"restart {restart}: starting at step {int(state.step)}")
    while int(state.step) < args.steps:
        state, metrics = step(state, eqxpar.data.global_batch(next(batches), plan))
        done = int(state.step)
        dist.print_once(f"step {done}: loss {float(metrics['loss']):.6f}")
        stop = guard.should_stop(done)
        if stop or done % args.save_every == 0:
            manager.save(done, state, data_state=batches.get_state())
        if stop:
            manager.wait()
            dist.log(f"stopping: saved step {done}")
            break
        if fault is not None and fault[:2] == (dist.process_index(), done):
            _fail(fault[2], done)
        time.sleep(args.step_delay)
    manager.close()
    if args.params_out and guard.stop_step is None:  # the same on every process
        flat = jax.tree_util.tree_flatten_with_path(eqx.filter(state.model, eqx.is_inexact_array))[0]
        gathered = multihost_utils.process_allgather([leaf for _, leaf in flat], tiled=True)
        if dist.is_main_process():
            names = [jax.tree_util.keystr(path) for path, _ in flat]
            np.savez(args.params_out, **{n: np.asarray(g) for n, g in zip(names, gathered, strict=True)})
    dist.print_once(f"done at step {int(state.step)}")


def measure_async_save(args: argparse.Namespace) -> None:
    """Median step time with an asynchronous save in flight, and without, in this process."""
    import jax

    import eqxpar.checkpoint
    import eqxpar.data

    plan, state, step, batches = _setup(args.width)

    def timed_step(state):
        batch = eqxpar.data.global_batch(next(batches), plan)
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        return state, time.perf_counter() - start

    with tempfile.TemporaryDirectory() as directory:
        manager = eqxpar.checkpoint.CheckpointManager(directory, max_to_keep=2)
        for _ in range(3):  # compile, warm up
            state, _ = timed_step(state)
        quiet, busy, in_flight = [], [], 0
        for _ in range(args.repeats):
            state, seconds = timed_step(state)
            quiet.append(seconds)
            saved = int(state.step)
            manager.save(saved, state, data_state=batches.get_state())
            state, seconds = timed_step(state)
            busy.append(seconds)
            # Still being written when the step ended: the step really overlapped it.
            in_flight += not (pathlib.Path(directory) / str(saved)).exists()
            manager.wait()
        manager.close()
    a, b = statistics.median(busy), statistics.median(quiet)
    print(
        f"width {args.width}: median step {a * 1e3:.2f} ms with an async save in flight "
        f"({in_flight}/{args.repeats} steps ended before the save did), {b * 1e3:.2f} ms without; "
        f"ratio {a / b:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    options = _parse(sys.argv[1:])
    if options.measure_async_save:
        measure_async_save(options)
    else:
        train(options)
