"""The plan: one frozen object that says how a training step is parallelised."""

import contextvars
import dataclasses
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._errors import AxisNameError, PlanError
from ._mesh import BATCH_AXES
from ._rules import Rule, as_rules, mesh_axis_names

# `with plan:` blocks nest per thread; the tokens to restore live beside the value.
_TOKENS = threading.local()
_CURRENT: contextvars.ContextVar["Plan | None"] = contextvars.ContextVar("eqxpar_plan", default=None)

Mode = Literal["auto", "manual"]


@dataclasses.dataclass(frozen=True, init=False)
class Plan:
    """How a model is laid out on a mesh and how its step is run.

    **Arguments:**

    - `mesh`: the device mesh (usually from `eqxpar.make_mesh`).
    - `rules`: a rule or sequence of rules (`eqxpar.rules`) mapping weights to
      PartitionSpecs; first match wins, unclaimed weights are replicated. The
      default (no rules) replicates every weight: data parallelism.
    - `batch_axes`: mesh axes the batch's leading dimension is split over; default
      the mesh's `data` and `fsdp` axes.
    - `annotations`: name -> PartitionSpec for `eqxpar.annotate(x, name)`. Defaults:
      `"batch"` and `"activations"` both split the leading dimension over
      `batch_axes`; entries given here override them.
    - `mode`: `"auto"` compiles the step with `jax.jit` and lets the compiler (GSPMD)
      insert collectives; `"manual"` runs the per-device step inside
      `jax.shard_map`, with eqxpar issuing the collectives itself.
    - `sequence_parallel`: tensor-parallel layers keep the activations between
      blocks split along the sequence over `tensor_axis` (all-gather before a
      column-parallel layer, reduce-scatter after a row-parallel one, norms on
      sequence shards) instead of replicated.
    - `tp_overlap`: in manual mode, tensor-parallel layers overlap their
      all-gather / reduce-scatter with the matmul as ring `ppermute` collective
      matmuls. Needs `sequence_parallel=True` (the ring splits the sequence).
    - `tensor_axis`: the mesh axis tensor-parallel layers split over.
    - `manual_axes`: with `mode="manual"`, the mesh axes the per-device step is
      manual over (default: all of them). Naming a subset, e.g. `("tensor",)`,
      gives a partial-manual step: eqxpar issues the tensor-parallel collectives
      inside `shard_map` while the other axes stay automatic, so the compiler
      splits the batch over `data` and reduces its gradients there.

    Validated when built: every mesh axis named by a rule or annotation must exist.
    Entering a plan (`with plan:`) makes it the one `eqxpar.annotate` resolves
    against; eqxpar's train steps enter it while tracing.

    ```python
    mesh = eqxpar.make_mesh(data=8)
    plan = eqxpar.Plan(mesh)                      # data parallel, automatic
    plan = eqxpar.Plan(mesh, mode="manual")       # data parallel in shard_map
    ```
    """

    mesh: Mesh
    rules: tuple[Rule, ...]
    batch_axes: tuple[str, ...]
    annotations: tuple[tuple[str, PartitionSpec], ...]
    mode: Mode
    sequence_parallel: bool
    tp_overlap: bool
    tensor_axis: str
    manual_axes: tuple[str, ...]

    def __init__(
        self,
        mesh: Mesh,
        *,
        rules: Rule | Sequence[Rule] | None = None,
        batch_axes: Sequence[str] | None = None,
        annotations: Mapping[str, PartitionSpec] | None = None,
        mode: str = "auto",
        sequence_parallel: bool = False,
        tp_overlap: bool = False,
        tensor_axis: str = "tensor",
        manual_axes: Sequence[str] | None = None,
    ):
        if not isinstance(mesh, Mesh):
            raise PlanError(
                f"Plan(mesh={mesh!r}): expected a jax.sharding.Mesh; build one with "
                "eqxpar.make_mesh(data=..., fsdp=..., tensor=..., pipe=...)."
            )
        names = tuple(mesh.axis_names)
        rules = as_rules(rules)
        for rule in rules:
            declared = getattr(rule, "mesh_axes", None)
            for axis in sorted(declared() if declared else ()):
                if axis not in names:
                    raise AxisNameError(
                        f"rule {rule!r} names mesh axis {axis!r}, but the mesh has axes "
                        f"{names}. Use one of those names."
                    )
        if batch_axes is None:
            batch_axes = tuple(a for a in BATCH_AXES if a in names)
        batch_axes = tuple(batch_axes)
        for axis in batch_axes:
            if axis not in names:
                raise AxisNameError(
                    f"Plan(batch_axes={batch_axes!r}) names mesh axis {axis!r}, but the "
                    f"mesh has axes {names}. Use one of those names."
                )
        table = {"batch": PartitionSpec(batch_axes), "activations": PartitionSpec(batch_axes)}
        for key, spec in dict(annotations or {}).items():
            if not isinstance(spec, PartitionSpec):
                spec = PartitionSpec(*spec)
            for entry in spec:
                for axis in mesh_axis_names(entry):
                    if axis not in names:
                        raise AxisNameError(
                            f"annotation {key!r} -> {spec} names mesh axis {axis!r}, but "
                            f"the mesh has axes {names}. Use one of those names."
                        )
            table[key] = spec
        if mode not in ("auto", "manual"):
            raise PlanError(f"Plan(mode={mode!r}): expected 'auto' or 'manual'.")
        if tensor_axis not in names:
            raise AxisNameError(
                f"Plan(tensor_axis={tensor_axis!r}): the mesh has axes {names}. Use one of those names."
            )
        if tp_overlap and not sequence_parallel:
            raise PlanError(
                "Plan(tp_overlap=True) needs sequence_parallel=True: the ring collective "
                "matmuls pass sequence blocks around the tensor axis. Set sequence_parallel=True."
            )
        if manual_axes is not None:
            if mode != "manual":
                raise PlanError(
                    f"Plan(manual_axes={manual_axes!r}) needs mode='manual'; in mode='auto' "
                    "every axis is automatic. Set mode='manual' or drop manual_axes."
                )
            if isinstance(manual_axes, str):
                manual_axes = (manual_axes,)
            for axis in manual_axes:
                if axis not in names:
                    raise AxisNameError(
                        f"Plan(manual_axes={tuple(manual_axes)!r}) names mesh axis {axis!r}, but "
                        f"the mesh has axes {names}. Use some of those names."
                    )
            if not manual_axes:
                raise PlanError("Plan(manual_axes=()): name at least one axis, or use mode='auto'.")
            manual_axes = tuple(a for a in names if a in set(manual_axes))
        else:
            manual_axes = names if mode == "manual" else ()
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "batch_axes", batch_axes)
        object.__setattr__(self, "annotations", tuple(sorted(table.items())))
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "sequence_parallel", bool(sequence_parallel))
        object.__setattr__(self, "tp_overlap", bool(tp_overlap))
        object.__setattr__(self, "tensor_axis", tensor_axis)
        object.__setattr__(self, "manual_axes", manual_axes)

    @property
    def batch_size_multiple(self) -> int:
        """Number of devices the batch is split over (the data-parallel size)."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def batch_spec(self) -> PartitionSpec:
        """The PartitionSpec of a batch leaf: leading dimension over `batch_axes`."""
        return PartitionSpec(self.batch_axes)

    def annotation(self, name: str) -> PartitionSpec | None:
        """The spec registered for annotation `name`, or None."""
        return dict(self.annotations).get(name)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """A `NamedSharding` of `spec` on this plan's mesh."""
        return NamedSharding(self.mesh, spec)

    def __enter__(self) -> "Plan":
        _TOKENS.stack = getattr(_TOKENS, "stack", [])
        _TOKENS.stack.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.reset(_TOKENS.stack.pop())


def current_plan() -> Plan | None:
    """The plan entered with `with plan:` (or by an eqxpar step while tracing)."""
    return _CURRENT.get()
