"""Subprocess helper for the multi-process tests (run as a script; tests import only `hsdp_problem`).

_multihost_script.py train [--die-after-step N --die-rank R] -- <examples/multihost.py args>
    Trains with examples/multihost.py; with --die-after-step, once step N is done
    and every checkpoint so far is complete on all processes, process R kills
    itself with SIGKILL (a crash between steps).
_multihost_script.py crash-mid-save DIR
    Saves step 1 and waits; starts saving step 2 (a large state) and SIGKILLs
    itself while that save is still being written.
_multihost_script.py save-read-only DIR
    Opens a checkpoint manager on DIR, makes DIR read-only (dropping first root's
    right to write there anyway), saves step 1, prints the CheckpointError and
    the time, and exits.
_multihost_script.py restore-truncated DIR
    Saves steps 1 and 2 of a small sharded state, truncates step 2's largest
    file, prints the CheckpointError its restore raises, then restores step 1 and
    prints whether it equals what was saved. (A subprocess: the reads orbax
    abandons report errors from tensorstore's threads for a while afterwards.)
_multihost_script.py hsdp DIR   (under eqxpar.launch, 2 processes)
    Joins the run, lays a two-slice HSDP mesh (data across the processes, fsdp
    over each one's devices: make_mesh(dcn={"data": 2})), prints its groups'
    processes, trains `HSDP_STEPS` steps of the teacher MLP, saves the state
    (eqxpar.checkpoint) and, on process 0, the losses and final parameters.
_multihost_script.py fault KIND RANK DIR   (under eqxpar.launch)
    Joins the run, starts a grandchild that sleeps, writes "pid grandchild-pid"
    to DIR/pids<rank> and waits for every rank's file; then process RANK fails
    by KIND (raise, exit7, SIGKILL, SIGTERM; clean: every process exits 0, the
    others after catching a sys.exit(3)) while the others sleep.
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


def _drop_root_write_override() -> None:
    """Take from root its right to write where permissions forbid it (Linux capabilities)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        return
    drop = (1 << 1) | (1 << 2) | (1 << 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
    data[0].effective &= ~drop
    data[0].permitted &= ~drop
    libc.capset(ctypes.byref(header), data)


def save_read_only(directory: str) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    import jax.numpy as jnp

    import eqxpar.checkpoint

    path = pathlib.Path(directory)
    manager = eqxpar.checkpoint.CheckpointManager(path)
    if os.geteuid() == 0:
        _drop_root_write_override()
    path.chmod(0o555)
    try:
        (path / "probe").mkdir()
    except PermissionError:
        pass
    else:
        print("SKIP: this process can write into a read-only directory", flush=True)
        return
    try:
        manager.save(1, {"w": jnp.arange(8.0)})
        manager.wait()
    except eqxpar.checkpoint.CheckpointError as e:
        print(f"CheckpointError: {e}", flush=True)
    print(f"raised at {time.time()}", flush=True)
    # And now the process must exit.


def restore_truncated(directory: str) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    import jax.numpy as jnp
    import numpy as np

    import eqxpar
    from eqxpar.checkpoint import CheckpointError, CheckpointManager

    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=2), rules=eqxpar.rules.FSDP(min_size=1))
    state = eqxpar.shard({"w": jnp.arange(4096.0).reshape(64, 64), "b": jnp.ones(64)}, plan)
    path = pathlib.Path(directory)
    with CheckpointManager(path, max_to_keep=None) as manager:
        manager.save(1, state, data_state={"step": 1})
        manager.save(2, state, data_state={"step": 2})
    victim = max((p for p in (path / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with CheckpointManager(path) as manager:
        try:
            manager.restore(like=state, plan=plan)
        except CheckpointError as e:
            print(f"CheckpointError: {e}", flush=True)
        restored, data_state = manager.restore(1, like=state, plan=plan)
    same = all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state)
    print(f"step 1 restored equal: {same}, data_state {data_state}", flush=True)


HSDP_STEPS = 4


def hsdp_problem():
    """The model, optimizer, loss and global batches the HSDP run trains (and its
    one-device reference): every process builds the same ones."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(HSDP_STEPS, 32, 16)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(16, 4)).astype(np.float32) / 4)
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))

    def loss(model, batch):
        inputs, targets = batch
        return jnp.mean((jax.vmap(model)(inputs) - targets) ** 2)

    # SGD with momentum: unlike Adam it does not amplify the last-bit differences
    # of a gradient summed in another order (tests/_helpers.py, assert_params_close).
    return model, optax.sgd(0.1, momentum=0.9), loss, list(zip(x, y, strict=True))


def hsdp(directory: str) -> None:
    import eqxpar.distributed as dist

    assert dist.initialize(), "run me under eqxpar.launch"
    import json

    import equinox as eqx
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import eqxpar
    import eqxpar.checkpoint
    import eqxpar.data

    mesh = eqxpar.make_mesh(data=2, fsdp=4, dcn={"data": 2})
    groups = {
        axis: [
            d.process_index
            for d in np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])[
                0
            ]
        ]
        for axis in ("data", "fsdp")
    }
    dist.print_once(f"groups by process: {json.dumps(groups)}")
    plan = eqxpar.Plan(mesh, rules=eqxpar.rules.FSDP(min_size=256))
    model, optimizer, loss, batches = hsdp_problem()
    key = jax.random.wrap_key_data(
        jax.device_put(
            np.asarray(jax.random.key_data(jax.random.key(1))), plan.sharding(jax.sharding.PartitionSpec())
        )
    )
    state = eqxpar.train.init(model, optimizer, plan, key=key)
    step = eqxpar.train.make_step(loss, optimizer, plan)
    rows = eqxpar.data.process_slice(32, plan)
    dist.log(f"feeds rows {rows}")
    losses = []
    for x, y in batches:
        state, metrics = step(state, eqxpar.data.global_batch((x[rows], y[rows]), plan))
        losses.append(float(metrics["loss"]))
    with eqxpar.checkpoint.CheckpointManager(pathlib.Path(directory) / "ckpt") as manager:
        manager.save(HSDP_STEPS, state)
    params = eqx.filter(state.model, eqx.is_inexact_array)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    gathered = multihost_utils.process_allgather([leaf for _, leaf in flat], tiled=True)
    if dist.is_main_process():
        names = [jax.tree_util.keystr(path) for path, _ in flat]
        np.savez(
            pathlib.Path(directory) / "params.npz", **dict(zip(names, map(np.asarray, gathered), strict=True))
        )
        (pathlib.Path(directory) / "losses.json").write_text(json.dumps(losses))
    dist.print_once("hsdp done")


def fault(kind: str, rank: str, directory: str) -> None:
    import subprocess

    import eqxpar.distributed as dist

    assert dist.initialize(), "run me under eqxpar.launch"
    me, count = dist.process_index(), dist.process_count()
    here = pathlib.Path(directory)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (here / f"pids{me}.tmp").write_text(f"{os.getpid()} {grandchild.pid}")
    (here / f"pids{me}.tmp").rename(here / f"pids{me}")
    # The fault hits a run whose processes (and grandchildren) are all up.
    while not all((here / f"pids{r}").exists() for r in range(count)):
        time.sleep(0.02)
    if kind == "clean":
        if me != int(rank):
            try:
                sys.exit(3)  # caught: it must not become the exit status
            except SystemExit:
                pass
        print("done", flush=True)
        return
    if me == int(rank):
        print(f"failing by {kind}", flush=True)
        if kind == "raise":
            raise RuntimeError("rank broke: disk on fire")
        if kind == "exit7":
            sys.exit(7)
        os.kill(os.getpid(), getattr(signal, kind))
    time.sleep(600)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "train":
        train(rest)
    elif mode == "crash-mid-save":
        crash_mid_save(*rest)
    elif mode == "save-read-only":
        save_read_only(*rest)
    elif mode == "restore-truncated":
        restore_truncated(*rest)
    elif mode == "fault":
        fault(*rest)
    elif mode == "hsdp":
        hsdp(*rest)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
