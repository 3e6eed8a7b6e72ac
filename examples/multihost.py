"""Multi-process training with global batches, sharded checkpoints and resume.

A small MLP learns a fixed random teacher function, data parallel or FSDP over
all devices of all processes. Each process feeds only its rows of every global
batch (`eqxpar.data.ShardedIterator`), so the run sees the same data whatever the
number of processes; every `--ckpt-every` steps the state and the data position
are saved (each process writes its own shards, in the background), and
`--resume` continues from the newest checkpoint.

    python -m eqxpar.launch -n 2 --devices-per-process 4 examples/multihost.py \\
        --steps 20 --ckpt-dir /tmp/eqxpar-ckpt              # 2 processes x 4 devices
    python examples/multihost.py --steps 20 --ckpt-dir /tmp/eqxpar-ckpt --resume
                                                            # 1 process x 8 devices

Both print the same losses: the global batches, the mesh and the arithmetic are
the same; only where the rows live differs.
"""

import os

# The launcher gives each process its device count; alone, simulate 8 devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import eqxpar.distributed as dist  # noqa: E402

# Before anything else touches JAX: joins the run the launcher (or Slurm, mpirun,
# Kubernetes) started, or does nothing when the script runs alone.
dist.initialize()

import argparse  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

import eqxpar  # noqa: E402
import eqxpar.checkpoint  # noqa: E402
import eqxpar.data  # noqa: E402


def make_data(examples: int, d_in: int, d_out: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A teacher-student regression set; every process builds the same one."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, d_in)).astype(np.float32)
    teacher = rng.normal(size=(d_in, d_out)).astype(np.float32) / np.sqrt(d_in)
    y = np.tanh(x @ teacher) + 0.05 * rng.normal(size=(examples, d_out)).astype(np.float32)
    return x, y.astype(np.float32)


def loss_fn(model: eqx.nn.MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_plan(kind: str) -> eqxpar.Plan:
    if kind == "data":
        return eqxpar.Plan(eqxpar.make_mesh(data=-1))
    return eqxpar.Plan(eqxpar.make_mesh(fsdp=-1), rules=eqxpar.rules.FSDP(min_size=256))


def replicated_key(seed: int, plan: eqxpar.Plan) -> jax.Array:
    # A key placed on the whole mesh: built from host data, which every process
    # has, rather than from a single-device key array, which cannot be moved onto
    # devices of other processes.
    data = np.asarray(jax.random.key_data(jax.random.key(seed)))
    return jax.random.wrap_key_data(jax.device_put(data, plan.sharding(PartitionSpec())))


def host_params(model: eqx.Module) -> dict[str, np.ndarray]:
    """Every parameter as a whole numpy array on every process (gathers shards)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    gathered = multihost_utils.process_allgather([leaf for _, leaf in flat], tiled=True)
    return {jax.tree_util.keystr(path): np.asarray(g) for (path, _), g in zip(flat, gathered, strict=True)}


def main(argv: list[str] | None = None, *, on_step: Callable | None = None) -> dict[int, float]:
    """Train; return {step: loss} for the steps this run took.

    `on_step(step, state, manager)` is called after each step (and its checkpoint).
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--plan", choices=["data", "fsdp"], default="fsdp")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint directory (none: no checkpoints)")
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--metrics-json", default=None, help="process 0 writes {step: loss} here")
    parser.add_argument("--params-out", default=None, help="process 0 writes the final parameters (.npz)")
    args = parser.parse_args(argv)

    plan = make_plan(args.plan)
    dist.print_once(
        f"{jax.process_count()} process(es) x {jax.local_device_count()} devices, mesh "
        f"{ {k: v for k, v in plan.mesh.shape.items() if v > 1} }, plan {args.plan}"
    )
    d_in, d_out = 16, 4
    x, y = make_data(args.examples, d_in, d_out, seed=args.seed)
    model = eqx.nn.MLP(d_in, d_out, args.width, 2, key=jax.random.key(args.seed))
    optimizer = optax.adamw(3e-3)
    state = eqxpar.train.init(model, optimizer, plan, key=replicated_key(args.seed + 1, plan))
    step = eqxpar.train.make_step(loss_fn, optimizer, plan)
    batches = eqxpar.data.ShardedIterator((x, y), plan, batch_size=args.batch_size, seed=args.seed)
    dist.log(f"feeds rows {eqxpar.data.process_slice(args.batch_size, plan)} of each global batch")

    manager = None
    if args.ckpt_dir:
        manager = eqxpar.checkpoint.CheckpointManager(args.ckpt_dir, max_to_keep=args.keep)
        if args.resume and manager.latest_step() is not None:
            state, data_state = manager.restore(like=state, plan=plan)
            batches.set_state(data_state)
            dist.print_once(f"resumed from step {int(state.step)} of {args.ckpt_dir}")

    losses: dict[int, float] = {}
    while int(state.step) < args.steps:
        state, metrics = step(state, eqxpar.data.global_batch(next(batches), plan))
        done = int(state.step)
        losses[done] = float(metrics["loss"])
        dist.print_once(f"step {done}: loss {losses[done]:.6f}")
        if manager is not None and done % args.ckpt_every == 0:
            manager.save(done, state, data_state=batches.get_state())
        if on_step is not None:
            on_step(done, state, manager)
    if manager is not None:
        manager.close()

    params = host_params(state.model) if args.params_out else None
    if dist.is_main_process():
        if args.metrics_json:
            with open(args.metrics_json, "w") as f:
                json.dump({str(k): v for k, v in losses.items()}, f)
        if params is not None:
            np.savez(args.params_out, **params)
    dist.print_once(f"final loss {losses[max(losses)]:.6f}" if losses else "nothing to do")
    return losses


if __name__ == "__main__":
    main()
