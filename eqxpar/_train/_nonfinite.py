"""Skipping train steps whose loss or gradient is not finite
(`make_step(..., skip_nonfinite=True)`), and `SkipMonitor`, which stops a run that
keeps skipping."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import optax
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, PyTree

from .._errors import NonFiniteError, PlanError
from .._mesh import mesh_platform
from ._step_layout import StepLayout
from ._train_state import TrainState


def gradient_norm(grads: PyTree) -> Float[Array, ""]:
    """The global L2 norm of `grads`, summed in at least float32.

    The step's `grad_norm` metric and its finiteness check: float16 gradients
    squared in float16 overflow once the norm passes 256, which would count a
    healthy step as non-finite; in float32 only a norm past ~1.8e19 does. (float32
    and float64 gradients are summed in their own dtype, as `optax.tree.norm` does.)
    """
    wide = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads)
    return optax.tree.norm(wide)


def is_finite_step(loss: Array, grad_norm: Array) -> Bool[Array, ""]:
    """Whether a step's loss and gradient norm are both finite. A NaN or inf in any
    gradient element makes the norm NaN or inf, so one reduction (the one the
    `grad_norm` metric already needs) checks every gradient."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def select_if_finite(finite: Bool[Array, ""], new: PyTree, old: PyTree) -> PyTree:
    """`new`'s arrays where the step is finite, else `old`'s (same structure); the
    non-array leaves of `new`."""
    new_arrays, static = eqx.partition(new, eqx.is_array)
    old_arrays = eqx.filter(old, eqx.is_array)
    # One elementwise select per array, which XLA fuses into the update that
    # produced `new`; a `lax.cond` would keep the update out of that fusion.
    chosen = jax.tree.map(lambda n, o: lax.select(finite, n, o), new_arrays, old_arrays)
    return eqx.combine(chosen, static)


def count_skipped(skipped_steps: Array, finite: Bool[Array, ""]) -> Array:
    """`skipped_steps`, one more where the step was not `finite`."""
    return skipped_steps + jnp.logical_not(finite).astype(skipped_steps.dtype)


def keep_unless_finite(old: TrainState, new: TrainState, finite: Bool[Array, ""]) -> TrainState:
    """`new` when the step was finite; otherwise `old`'s parameters and optimizer
    state (its counters included) with `new`'s step and one more skipped step.

    The step counter advances either way: it counts the batches the run has
    consumed, keeps checkpoint step numbers unique, and gives the next batch a
    fresh dropout key (`fold_in(key, step)`); optax's own counters, which drive
    learning-rate schedules, count only the updates applied.
    """
    return TrainState(
        model=select_if_finite(finite, new.model, old.model),
        opt_state=select_if_finite(finite, new.opt_state, old.opt_state),
        step=new.step,
        key=new.key,
        skipped_steps=count_skipped(old.skipped_steps, finite),
    )


#: The first jaxlib whose XLA:CPU ran the skipping automatic-FSDP step without a hang.
_CPU_OVERLAP_FIXED_JAXLIB = (0, 12)


def _jaxlib_version() -> tuple[int, int]:
    major, minor = (int(part) for part in jaxlib.__version__.split(".")[:2])
    return major, minor


def _axes_of(entry: Any) -> tuple[str, ...]:
    # A PartitionSpec entry: None, an axis name, or a tuple of axis names.
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _has_loop(jaxpr: jcore.Jaxpr) -> bool:
    # A scan or while loop anywhere in `jaxpr`, its sub-jaxprs (jit, remat,
    # custom derivatives, shard_map, cond branches) included.
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            return True
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                inner = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
                if isinstance(inner, jcore.Jaxpr) and _has_loop(inner):
                    return True
    return False


def check_cpu_skip_nonfinite(layout: StepLayout, step_jaxpr: Callable[[], jcore.ClosedJaxpr]) -> None:
    """Refuse `skip_nonfinite=True` where XLA:CPU before jaxlib 0.12 was seen to hang:
    a step with a loop (a scanned stack, accumulation) whose parameters are sharded
    over an axis the compiler partitions (automatic FSDP or tensor parallelism), so
    that GSPMD gathers them inside the loop and after it. `step_jaxpr` traces the
    step; it is called only when the rest holds.

    XLA:CPU runs a device's operations concurrently as their buffers allow, and
    orders two collectives only by a scheduling edge: the later one may start once
    the earlier one has *started*. A collective after a scanned stack (the gather of
    the final norm's weight) can so start while the stack's loop, whose body
    gathers each layer's weights, still runs. Each in-process collective holds a
    thread of the CPU client's pool while it waits for the other devices, and once
    every thread is held the loops cannot go on: the process aborts after a 40 s
    rendezvous timeout. Whether the later collective waits for the loop comes down
    to buffer assignment (a temporary buffer the two happen to share orders them),
    which the check's select on the old state changes. It was seen with 8 devices
    and a pool of up to 8 threads on jaxlib 0.10.2; jaxlib 0.12 ran the same step
    with a pool of one, and steps without a loop ran on 0.10.2.
    """
    mesh = layout.plan.mesh
    if mesh_platform(mesh) != "cpu" or _jaxlib_version() >= _CPU_OVERLAP_FIXED_JAXLIB:
        return
    specs = jax.tree.leaves(layout.params, is_leaf=lambda s: isinstance(s, PartitionSpec))
    named = {a for s in specs if isinstance(s, PartitionSpec) for e in s for a in _axes_of(e)}
    gathered = sorted(
        (a for a in named if mesh.shape[a] > 1 and a not in layout.manual_axes),
        key=mesh.axis_names.index,
    )
    if not gathered or not _has_loop(step_jaxpr().jaxpr):
        return
    raise PlanError(
        f"make_step(..., skip_nonfinite=True): on XLA:CPU with jaxlib {jaxlib.__version__}, this step "
        f"loops (a scanned stack, or accumulate > 1) over parameters sharded over {gathered}, which "
        f"the compiler partitions (mode={layout.mode!r}), and such a step can hang and abort the "
        "process: XLA:CPU before jaxlib 0.12 may start a later weight gather while the loop's "
        "gathers still run, and the devices' waiting collectives then hold every thread of its "
        "pool. Use jaxlib >= 0.12, or mode='manual' (eqxpar issues the gathers; its FSDP steps "
        "skip without a hang), or drop skip_nonfinite and wrap the optimizer in "
        "optax.apply_if_finite(optimizer, max_consecutive_errors) (it checks the gradients, not "
        "the loss)."
    )


class SkipMonitor:
    """Stop a run that keeps skipping: raise `eqxpar.NonFiniteError` once
    `max_consecutive` steps in a row were skipped for a non-finite loss or gradient.

    A step built with `make_step(..., skip_nonfinite=True)` leaves the
    state unchanged on such a step, so a run whose every batch gives NaN would go on
    without training. Call the monitor with each step's metrics; it reads the
    step's `skipped` flag, which waits for that step to finish (as reading the loss
    does). A single bad batch, or a few, pass; a run stuck on NaN stops with an
    error that says so.

    **Arguments:**

    - `max_consecutive`: the number of consecutive skipped steps that raises
      (an integer >= 1, keyword-only; default 10).

    Attributes: `consecutive`, the skipped steps in a row so far.

    ```python
    monitor = eqxpar.train.SkipMonitor(max_consecutive=10)
    for batch in batches:
        state, metrics = step(state, batch)
        monitor(metrics)
    ```
    """

    def __init__(self, *, max_consecutive: int = 10):
        if not isinstance(max_consecutive, int) or isinstance(max_consecutive, bool) or max_consecutive < 1:
            raise PlanError(f"SkipMonitor(max_consecutive={max_consecutive!r}): expected an integer >= 1.")
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def __call__(self, metrics: dict[str, Any]) -> None:
        """Count the step whose `metrics` these are.

        **Arguments:**

        - `metrics`: the metrics a step returned (with `skipped` and
          `skipped_steps`, as a step built with `skip_nonfinite=True` gives).

        **Returns:** None.

        **Raises:** `eqxpar.NonFiniteError` when this is the `max_consecutive`-th
        skipped step in a row; `eqxpar.PlanError` for metrics without `skipped`.
        """
        if not isinstance(metrics, dict) or "skipped" not in metrics:
            keys = sorted(metrics) if isinstance(metrics, dict) else type(metrics).__name__
            raise PlanError(
                f"SkipMonitor: expected the metrics of a step built with skip_nonfinite=True, which "
                f"hold 'skipped' and 'skipped_steps'; got {keys}. Build the step with "
                "eqxpar.train.make_step(..., skip_nonfinite=True)."
            )
        if not bool(metrics["skipped"]):
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.consecutive} consecutive train steps were skipped for a non-finite loss or "
                f"gradient (last loss {float(metrics['loss'])!r}, grad_norm "
                f"{float(metrics['grad_norm'])!r}; {int(metrics['skipped_steps'])} skipped in all): "
                "the run is not training. The parameters are those of the last finite step. Look "
                "for NaN or inf in the data, a learning rate too high, or float16 overflow; then "
                "restore a checkpoint and resume, or raise SkipMonitor(max_consecutive=...) if "
                "such runs of bad batches are expected."
            )
