"""Subprocess helper for the multi-process tests (run as a script, never imported by pytest).

_multihost_script.py train [--die-after-step N --die-rank R] -- <examples/multihost.py args>
    Trains with examples/multihost.py; with --die-after-step, once step N is done
    and every checkpoint so far is complete on all processes, process R kills
    itself with SIGKILL (a crash between steps).
_multihost_script.py crash-mid-save DIR
    Saves step 1 and waits; starts saving step 2 (a large state) and SIGKILLs
    itself while that save is still being written.
"""

import os
import pathlib
import signal
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def train(argv: list[str]) -> None:
    die_after = die_rank = None
    if "--die-after-step" in argv:
        i = argv.index("--die-after-step")
        die_after = int(argv[i + 1])
        j = argv.index("--die-rank")
        die_rank = int(argv[j + 1])
        argv = [a for k, a in enumerate(argv) if k not in (i, i + 1, j, j + 1)]
    if argv and argv[0] == "--":
        argv = argv[1:]
    sys.path.insert(0, str(ROOT / "examples"))
    import multihost  # sets XLA_FLAGS and joins the run before importing jax

    def on_step(step, state, manager):
        if step != die_after:
            return
        from jax.experimental import multihost_utils

        import eqxpar.distributed as dist

        if manager is not None:
            manager.wait()
        # Every process has finished writing before the victim dies, so the
        # crash falls between steps, not inside a save.
        multihost_utils.sync_global_devices("before-crash")
        if dist.process_index() == die_rank:
            dist.log(f"killing myself with SIGKILL after step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        # The survivor trains on and blocks in its next collective, as a real
        # peer of a crashed process would, until the launcher stops it.

    multihost.main(argv, on_step=on_step)


def crash_mid_save(directory: str) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    import jax
    import jax.numpy as jnp

    import eqxpar.checkpoint

    manager = eqxpar.checkpoint.CheckpointManager(directory, max_to_keep=5)
    small = {"w": jnp.arange(8.0), "key": jax.random.key(3)}
    manager.save(1, small, data_state={"step": 1, "seed": 0})
    manager.wait()
    # Large enough that writing it takes far longer than noticing it started.
    big = {"w": jnp.ones((64, 1024, 1024), jnp.float32), "key": jax.random.key(4)}
    manager.save(2, big, data_state={"step": 2, "seed": 0})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(".orbax-checkpoint-tmp" in p.name for p in pathlib.Path(directory).iterdir()):
            break
        time.sleep(0.001)
    print("crashing mid-save", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "train":
        train(rest)
    elif mode == "crash-mid-save":
        crash_mid_save(*rest)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
