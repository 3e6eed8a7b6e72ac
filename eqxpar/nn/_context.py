"""How a tensor-parallel layer should run right now.

A layer does not take a mode argument: it reads the context it is traced in. If
its mesh axis is manual (`jax.sharding.get_abstract_mesh().manual_axes`, i.e. we
are inside a `shard_map` over it) the layer holds per-device weight shards and
issues its own collectives; otherwise it holds global weights and only constrains
its activations, leaving the collectives to the compiler. Sequence parallelism
and overlap come from the active plan (`with plan:`; eqxpar's steps enter it).
"""

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._errors import PlanError
from .._parallel_dims import ParallelDims
from .._plan import current_plan


@dataclasses.dataclass(frozen=True)
class TensorContext:
    """The tensor-parallel settings a layer runs under.

    - `axis`: the mesh axis weights are split over.
    - `manual`: whether `axis` is manual here (inside `shard_map`).
    - `size`: the number of devices along `axis` (1 without a mesh).
    - `sequence_parallel`: activations between blocks are split along the sequence.
    - `overlap`: use ring collective matmuls (manual mode only).
    - `batch_axes`: mesh axes of the activations' leading (batch) dimension.
    """

    axis: str
    manual: bool
    size: int
    sequence_parallel: bool
    overlap: bool
    batch_axes: tuple[str, ...]

    def constrain(self, x: jax.Array, *entries: object) -> jax.Array:
        """In automatic mode under a plan, constrain `x` to `P(batch_axes, *entries)`;
        otherwise return it unchanged."""
        plan = current_plan()
        if self.manual or plan is None or not isinstance(x, jax.core.Tracer):
            return x
        manual = set(jax.sharding.get_abstract_mesh().manual_axes)
        if manual:
            # Inside another manual region (e.g. a pipeline stage): only the
            # automatic axes can still be constrained.
            return x
        # A mesh axis the plan names among its batch axes already splits the batch
        # (rules that split no weight over it make the tensor axis one more data
        # axis): the layer's feature split leaves it out, since one axis cannot
        # split two dimensions. The constraint only guides the compiler; the
        # values are the same either way.
        batch = tuple(self.batch_axes)
        spec = PartitionSpec(batch or None, *(_without(entry, batch) for entry in entries))
        return jax.lax.with_sharding_constraint(x, NamedSharding(plan.mesh, spec))

    def seq(self) -> str | None:
        """The spec entry of the sequence dimension between blocks."""
        return self.axis if self.sequence_parallel else None


def _without(entry: object, taken: tuple[str, ...]) -> object:
    """A spec entry (None, an axis name or a tuple of them) without the axes in `taken`."""
    if entry is None or not taken:
        return entry
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(n for n in names if n not in taken)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def tensor_context(axis: str) -> TensorContext:
    """The `TensorContext` for a layer splitting its weights over mesh axis `axis`."""
    plan = current_plan()
    abstract = jax.sharding.get_abstract_mesh()
    manual = axis in abstract.manual_axes
    if plan is not None:
        if axis not in plan.mesh.axis_names:
            raise PlanError(
                f"a layer splits its weights over mesh axis {axis!r}, but the plan's mesh has "
                f"axes {tuple(plan.mesh.axis_names)}. Build the layer with axis=<one of those>."
            )
        dims, size = ParallelDims.of(plan), plan.mesh.shape[axis]
        return TensorContext(
            axis=axis,
            manual=manual,
            size=size,
            sequence_parallel=dims.sequence_parallel and dims.tensor_axis == axis,
            overlap=dims.tp_overlap and manual and dims.tensor_axis == axis,
            batch_axes=dims.batch_axes,
        )
    size = abstract.shape[axis] if manual else 1
    return TensorContext(
        axis=axis, manual=manual, size=size, sequence_parallel=False, overlap=False, batch_axes=()
    )
