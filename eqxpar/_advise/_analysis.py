"""What the advisor reads off the model and loss: once, on one device, for every
candidate plan, the loss's saved residuals, its matmul FLOPs and the model's
structure (`analyse`); per pipeline plan, the engine's own residual slot layout
(`engine_slots`). Traced on shape outlines; nothing is compiled or run."""

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .._errors import PlanError
from .._sizes import array_bytes, itemsize
from .._specs import is_array_like
from .._text import short
from ..inspect import matmul_flops
from ..inspect._model_layers import attention_layers


def outline(tree: Any) -> Any:
    """`tree` with every array leaf a `jax.ShapeDtypeStruct`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array_like(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class Analysis:
    """The loss on the whole global batch on one device.

    - `residuals`: outlines of the values its backward pass reads that are not
      parameters or batch (`jax.vjp`'s residuals).
    - `forward_flops`: 2 x the multiply-adds of its matmuls (forward only).
    - `batch_size`, `seq_len`: the batch's leading dimension and its sequence
      dimension (None without one).
    - `row_bytes`: bytes per batch row of the activations between blocks.
    - `routed`: the outline of one MoE layer's routed rows (global), or None.
    - `layers`: attention layers (`eqxpar.nn.Attention`, stacked ones counted per layer).
    """

    residuals: tuple[jax.ShapeDtypeStruct, ...]
    forward_flops: int
    batch_size: int
    seq_len: int | None
    row_bytes: int
    routed: jax.ShapeDtypeStruct | None
    layers: int


def analyse(model: Any, loss: Callable, batch: Any) -> Analysis:
    """Trace `loss(model, batch)` and its VJP on outlines (global batch, one device)."""
    from ..nn._moe import record_dispatches

    model, batch = outline(model), outline(batch)
    floating = lambda x: is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    params, static = eqx.partition(model, floating)

    def residuals(params: Any, batch: Any) -> list:
        f = lambda p: loss(eqx.combine(p, static), batch)  # noqa: E731
        return jax.tree.leaves(jax.vjp(f, params)[1])

    try:
        with record_dispatches() as routed:
            closed = jax.make_jaxpr(residuals)(params, batch)
        forward = jax.make_jaxpr(lambda p, b: loss(eqx.combine(p, static), b))(params, batch)
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(
            f"advise: tracing loss_fn(model, batch) on their outlines failed ({type(e).__name__}: "
            f"{short(str(e))}). Pass the loss the step differentiates, with a global batch it accepts."
        ) from e
    inputs = set(v for v in closed.jaxpr.invars)
    saved = tuple(
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v in closed.jaxpr.outvars
        if not isinstance(v, jcore.Literal) and v not in inputs and v.aval.shape
    )
    leaves = [x for x in jax.tree.leaves(batch) if is_array_like(x) and x.ndim]
    if not leaves:
        raise PlanError("advise(batch=...): the batch has no array with a leading (batch) dimension.")
    size = int(leaves[0].shape[0])
    # The sequence: a batch dimension beyond the first (or one less: next-token
    # targets), the one the residuals have most often.
    options = {d - k for x in leaves for d in x.shape[1:] for k in (0, 1) if d - k > 1}
    counts = Counter(d for r in saved for d in r.shape if d in options)
    seq = counts.most_common(1)[0][0] if counts else None
    # Bytes per batch row of the activations between blocks: (seq, features) with
    # the features the residuals end in most often after the sequence.
    ends = Counter((r.shape[-1], r.dtype) for r in saved if r.ndim >= 3 and r.shape[-2] == seq)
    width, dtype = ends.most_common(1)[0][0] if ends else (0, jnp.float32)
    row = (seq or 1) * width * itemsize(dtype)
    return Analysis(
        residuals=saved,
        forward_flops=matmul_flops(forward),
        batch_size=size,
        seq_len=seq,
        row_bytes=row,
        routed=routed[0] if routed else None,
        layers=_layers(model),
    )


def _layers(model: Any) -> int:
    return sum(a.wo.shape[0] if a.wo.ndim == 4 else 1 for a in attention_layers(model))


@dataclasses.dataclass(frozen=True)
class Slots:
    """What the pipeline engine keeps per micro-batch in flight on one device, as
    the engine itself lays it out for a plan (`engine_slots`).

    - `groups`: `(dtype name, varying axes) -> elements` of one residual slot: the
      engine packs each virtual stage's kept residuals into one vector per group,
      as long as the largest kind of stage (first, middle, last) needs.
    - `leaves`: `(first, last) -> ((dtype name, local shape), ...)`, the kept
      residuals of each kind of virtual stage that stores them.
    - `stash`: as `groups`, for the slots a split backward's input half (`I`)
      fills for its weight half (`W`); empty where no backward is split.
    - `activation`: the outline of what crosses a stage boundary (per device).
    """

    groups: dict[tuple[str, tuple[str, ...]], int]
    leaves: dict[tuple, tuple[tuple[str, tuple[int, ...]], ...]]
    stash: dict[tuple[str, tuple[str, ...]], int]
    activation: jax.ShapeDtypeStruct

    @property
    def slot_bytes(self) -> int:
        """Bytes of one residual slot (all its group vectors)."""
        return _group_bytes(self.groups)

    @property
    def stash_bytes(self) -> int:
        """Bytes of one stash slot: what a split backward's input half hands its
        weight half (none where no backward is split)."""
        return _group_bytes(self.stash)

    def stacked_bytes(self, layers: int, rows: int) -> int:
        """Bytes of the residuals the stage's scanned layers keep (leading
        `(layers, rows)`: one per layer), for the kind of stage that keeps most."""
        sizes = [
            sum(array_bytes(shape, dtype) for dtype, shape in kind if shape[:2] == (layers, rows))
            for kind in self.leaves.values()
        ]
        return max(sizes, default=0)


def _group_bytes(groups: dict) -> int:
    return sum(n * itemsize(dtype) for (dtype, _), n in groups.items())


def _packings(device: Any) -> tuple[dict, dict, dict]:
    """`(groups, layout, stash groups)` of the engine's per-device residual
    packing (`device.residuals` and `device.stash`, `Packing`s)."""
    return device.residuals.groups, device.residuals.layout, device.stash.groups


def engine_slots(resolved: Any, loss: Any, model: Any, batch: Any) -> Slots:
    """The pipeline engine's own residual slot layout under `resolved` (a pipeline
    plan's `ResolvedPlan`; `loss` its `eqxpar.pipeline.PipelineLoss`; `model` and
    the global `batch` as arrays or outlines). The engine's per-device setup (`Device`, which resolves
    the layout by abstract evaluation) is traced inside `shard_map` on the plan's
    mesh, which may be a placeholder: nothing is placed or compiled. So the kept
    leaves are the engine's (those that vary along `pipe` under its varying-type
    rules, at their per-device shapes, under the plan's remat policy)."""
    from jax.sharding import PartitionSpec

    from .._rules import mesh_axis_names
    from .._shard_map import filter_shard_map
    from .._train._grad_common import LossFunction
    from .._train._step_layout import StepLayout
    from .._varying import mark_varying
    from ..pipeline._engine import Device, Engine

    model, batch = outline(model), outline(batch)
    layout = StepLayout.of(resolved, model)
    engine = Engine(LossFunction.wrap(loss, has_aux=False, compute_dtype=resolved.compute_dtype), layout)
    batch_axes = set(layout.reduced_axes)

    def whole(spec: Any) -> Any:
        # FSDP weights reach the engine gathered over the batch axes.
        if not isinstance(spec, PartitionSpec):
            return spec
        kept = [tuple(a for a in mesh_axis_names(e) if a not in batch_axes) for e in spec]
        return PartitionSpec(*[(k if len(k) > 1 else k[0]) if k else None for k in kept])

    found: dict = {}

    def per_device(model: Any, batch: Any) -> jax.Array:
        params, static = eqx.partition(model, eqx.is_inexact_array)
        params = jax.tree.map(lambda x: mark_varying(x, engine.local), params)
        device = Device(engine, params, static, batch, None)
        groups, layout, stash = _packings(device)
        found["groups"] = {key: int(n) for key, n in groups.items()}
        found["leaves"] = {
            kind: tuple((key[0], tuple(shape)) for key, _, shape in leaves) for kind, leaves in layout.items()
        }
        found["stash"] = {key: int(n) for key, n in stash.items()}
        found["activation"] = jax.ShapeDtypeStruct(device.act.shape, device.act.dtype)
        return jnp.zeros(())

    specs = jax.tree.map(whole, layout.params, is_leaf=lambda s: isinstance(s, PartitionSpec))
    fn = filter_shard_map(
        per_device,
        resolved.plan,
        in_specs=(specs, layout.batch),
        out_specs=PartitionSpec(),
        axis_names=frozenset(resolved.mesh.axis_names),
    )
    dynamic, static = eqx.partition(model, is_array_like)
    with resolved.plan:
        jax.make_jaxpr(lambda d, b: fn(eqx.combine(d, static), b))(dynamic, batch)
    return Slots(**found)
