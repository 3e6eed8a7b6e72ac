"""The step layout: where every array of a training step lives, resolved once.

A plan says what the user wants (a mesh, rules, a mode, flags); its
`ResolvedPlan` says what a step does that needs no model (manual axes, kind, batch
layout, dtypes); a `StepLayout` adds the state's outline: the specs of the
parameters, the gradients, the optimizer state and the batch, the batch axes
whose gradients it reduces by hand. `train.init`, the step, its gradient
implementations, the update, checkpoint restore and `eqxpar.inspect` all read
one; none decides these from the plan's flags again.
"""

import dataclasses
import math
from collections.abc import Collection
from typing import Any

import equinox as eqx
import jax
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import keystr
from jaxtyping import PyTree

from .._errors import BatchError, PlanError
from .._mesh import CONTEXT_AXIS, EXPERT_AXIS, mesh_platform
from .._plan import Plan
from .._rules import mesh_axis_names
from .._shard_map import region_manual_axes
from .._sharding import HOST_MEMORY, in_memory, shardings_of
from .._specs import leaves_with_layout, partition_specs
from .._stack_order import OrderedStack
from ._resolved_plan import Kind, ResolvedPlan
from ._trainable import split_trainable


def check_expert_specs(model: PyTree, specs: PyTree) -> None:
    """Raise unless every dimension split over the `expert` axis alone is an
    `experts` dimension (the stacked experts of an `eqxpar.nn.MoE`), and every
    `experts` dimension split over it is split over it alone.

    A dimension split over `expert` alone is never gathered (each device keeps
    its own experts), so such a split of any other dimension would leave a layer
    computing on a fragment of its weight. Beside other batch axes
    (`rules.EXPERT_FSDP`'s model dimension) `expert` is an FSDP split, gathered
    where the weight is used.
    """
    leaves, treedef = jax.tree.flatten(model)
    spec_leaves = treedef.flatten_up_to(specs)
    for (path, _, axes, _), spec in zip(leaves_with_layout(model), spec_leaves, strict=True):
        if not isinstance(spec, PartitionSpec):
            continue
        for dim, entry in enumerate(spec):
            names = mesh_axis_names(entry)
            if EXPERT_AXIS not in names:
                continue
            logical = None if axes is None else axes[dim]
            if (logical == "experts") != (names == (EXPERT_AXIS,)):
                raise PlanError(
                    f"the plan's rules give the weight {keystr(path)} the spec {spec}, splitting its "
                    f"dimension {dim} (logical axis {logical!r}) over {names}; the {EXPERT_AXIS!r} axis "
                    "alone splits the stacked experts of eqxpar.nn.MoE layers only (logical axis "
                    "'experts'), which each device keeps and never gathers; other weights may split over "
                    "it beside 'fsdp' (gathered where used). Map 'experts' to "
                    f"{EXPERT_AXIS!r} alone (rules.EXPERT), and other weights to 'fsdp' or "
                    f"('fsdp', {EXPERT_AXIS!r}) (rules.EXPERT_FSDP)."
                )


@dataclasses.dataclass(frozen=True, eq=False)
class StepLayout:
    """Where a training step's arrays live and which collectives it runs by hand.

    Build one with `StepLayout.of(resolved, model, opt_state)` (arrays or
    `jax.eval_shape` outlines) from a `ResolvedPlan` (`ResolvedPlan.of(plan)`, or a
    step's: `step.layout(state)`).

    **Fields:**

    - `resolved`: the `ResolvedPlan` it was laid out for (manual axes, kind,
      batch layout, dtypes: what needs no model).
    - `params`: a PartitionSpec per array leaf of the model (None elsewhere).
    - `updates`: the specs the gradients and optimizer updates come out in: the
      parameters', or under ZeRO-1 the optimizer state's split over the batch axes.
    - `opt_state`: a PartitionSpec per array leaf of the optimizer state, or None
      when resolved without one.
    - `trainable`: a bool per leaf of the model, True where a floating-point array
      trains (`make_step(..., trainable=...)`), or None: every one does.

    ```python
    resolved = eqxpar.internal.ResolvedPlan.of(plan)
    layout = eqxpar.internal.StepLayout.of(resolved, state.model, state.opt_state)
    layout.kind, layout.reduced_axes, layout.state_specs(state).opt_state
    ```
    """

    resolved: ResolvedPlan
    params: PyTree
    updates: PyTree
    opt_state: PyTree | None
    trainable: PyTree | None = None

    @classmethod
    def of(
        cls,
        resolved: ResolvedPlan,
        model: PyTree,
        opt_state: PyTree | None = None,
        *,
        trainable: PyTree | None = None,
    ) -> "StepLayout":
        """The layout of a step over `model` (and `opt_state`) under `resolved`;
        `trainable` is the step's resolved filter (`_trainable.trainable_mask`)."""
        plan = resolved.plan  # its mesh and rules
        rules, mesh = plan.optimizer_rules, plan.mesh
        params = partition_specs(model, plan.rules, mesh=mesh)
        if resolved.dims.expert_size > 1:
            check_expert_specs(model, params)
        updates = params if rules == plan.rules else partition_specs(model, rules, mesh=mesh)
        opt = None if opt_state is None else partition_specs(opt_state, rules, mesh=mesh)
        return cls(resolved, params, updates, opt, trainable)

    @property
    def plan(self) -> Plan:
        """The plan: its mesh and rules, and the `with plan:` context a step traces in."""
        return self.resolved.plan

    @property
    def accumulate(self) -> int:
        return self.resolved.accumulate

    @property
    def manual_axes(self) -> frozenset[str]:
        """The mesh axes the step runs inside `shard_map`."""
        return self.resolved.manual_axes

    def differentiated(self, model: PyTree) -> tuple[PyTree, PyTree]:
        """`(params, rest)` of `model` (the global model, or one device's inside a
        manual region: the same structure): the arrays the step differentiates and
        updates, None elsewhere, and everything else (frozen weights included)."""
        return split_trainable(model, self.trainable)

    @property
    def kind(self) -> Kind:
        """Which gradient implementation runs: compiler-placed collectives
        (`"automatic"`), a `shard_map` region (`"manual"`), or the pipeline engine."""
        return self.resolved.kind

    @property
    def batch(self) -> PartitionSpec:
        """The spec of a batch leaf: leading dimension over the plan's batch axes."""
        return self.resolved.batch.spec

    @property
    def tensor_axis(self) -> str:
        """The mesh axis tensor-parallel layers split their weights over."""
        return self.resolved.tensor_axis

    @property
    def mode(self) -> str | None:
        """The plan's mode as the user gave it (`"auto"`, `"manual"`, or None under a pipeline), for messages."""
        return self.resolved.dims.mode

    @property
    def reduce_dtype(self) -> Any:
        """The dtype gradients are reduced in (`Plan(reduce_dtype=)`), or None for theirs."""
        return self.resolved.reduce_dtype

    @property
    def weight_axes(self) -> frozenset[str]:
        """The manual axes a weight may be split over in a manual region: the tensor
        axis (eqxpar.nn layers take its shards) and the batch axes (FSDP: the step
        gathers them)."""
        return frozenset({self.tensor_axis, *self.resolved.batch.axes})

    @property
    def sequence_split(self) -> bool:
        """Whether each device of the tensor axis holds its own sequence block in the
        manual region (sequence parallelism over a manual tensor axis of size > 1)."""
        dims = self.resolved.dims
        return dims.sequence_parallel and dims.tensor_axis in self.manual_axes and dims.tensor_size > 1

    @property
    def reduced_axes(self) -> tuple[str, ...]:
        """The axes whose devices each compute a share of the loss that the step
        averages, and whose gradients it so reduces itself: the batch axes it splits
        the batch over by hand (batch axes left automatic are the compiler's), then
        `context` when it splits the sequence (each device's loss is the mean over
        its own part of the sequence)."""
        axes = tuple(a for a in self.resolved.batch.axes if a in self.manual_axes)
        return axes + self.context_axes

    @property
    def unsplit_axes(self) -> frozenset[str]:
        """The mesh's axes of size 1: a spec naming one beside others splits nothing
        over it (`rules.EXPERT_FSDP`'s `("fsdp", "expert")` on a mesh without fsdp)."""
        return frozenset(a for a, n in self.plan.mesh.shape.items() if n == 1)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """`("context",)` when the step splits the sequence over it (size > 1), else `()`."""
        return (CONTEXT_AXIS,) if self.resolved.dims.context_size > 1 else ()

    @property
    def data_parallel_size(self) -> int:
        """Devices the loss is averaged over by hand: those of `reduced_axes` (the
        divisor of the gradient reduction)."""
        return math.prod(self.plan.mesh.shape[a] for a in self.reduced_axes)

    def loss_divisor(self, varying: Collection[str]) -> int:
        """The divisor of the gradient reduction for a per-device loss that differs
        between devices along the manual axes `varying`: the sizes of the reduced
        axes along which it does. Marked varying, the weights get the gradient of the
        sum of those devices' losses, which the step averages; along a reduced axis
        where the loss is one value on every device (averaged inside the loss), they
        get its gradient already."""
        return math.prod(self.plan.mesh.shape[a] for a in self.reduced_axes if a in varying)

    @property
    def partial(self) -> bool:
        """Whether the step's region is manual over some mesh axes only."""
        return self.resolved.partial

    @property
    def sliced_update(self) -> bool:
        """Whether each device updates a slice of the parameters (ZeRO-1): the
        updates' specs differ from the parameters'."""
        return self.updates is not self.params

    def state_specs(self, state: Any) -> Any:
        """`state` (a `TrainState` or its outline) with a PartitionSpec at every
        array leaf: the model's and optimizer's from this layout, the step, key
        and skipped-step count replicated."""
        if self.opt_state is None:
            raise PlanError(
                "this StepLayout was resolved without an optimizer state; build it with "
                "StepLayout.of(resolved, state.model, state.opt_state)."
            )
        return eqx.tree_at(
            lambda s: (s.model, s.opt_state, s.step, s.key, s.skipped_steps),
            state,
            (self.params, self.opt_state, PartitionSpec(), PartitionSpec(), PartitionSpec()),
            is_leaf=lambda x: x is None,
        )

    def memory_kind(self, part: str) -> str | None:
        """Where the step keeps `part` (`"params"` or `"optimizer"`) between steps:
        `"pinned_host"` when the plan offloads it (`Plan(offload=...)`), else None
        (the device's memory)."""
        return HOST_MEMORY if part in self.resolved.dims.offload else None

    def state_shardings(self, state: Any) -> Any:
        """`state` (a `TrainState`, its outline or its non-static part) with the
        `NamedSharding` of every array leaf between steps: `state_specs`' specs,
        in host memory for the parts the plan offloads."""
        shardings = self.shardings(self.state_specs(state))
        return eqx.tree_at(
            lambda s: (s.model, s.opt_state),
            shardings,
            (
                in_memory(shardings.model, self.memory_kind("params")),
                in_memory(shardings.opt_state, self.memory_kind("optimizer")),
            ),
            is_leaf=lambda x: x is None,
        )

    def optimizer_state_onto_device(self, opt_state: PyTree) -> PyTree:
        """Inside the compiled step, once the gradients exist: an offloaded
        optimizer state (`Plan(offload=("optimizer",))`) moved to the device's
        memory for the update. Moved at the top of the step, the TPU compiler
        held its copy through the backward pass, whose peak it raised by its size
        (Llama-3-8B, 4 layers: no fall at all); moved here, after the backward
        pass, the peak fell by 53 % of it. (An optimization barrier tying the
        transfer to the gradients gained 3 points more on the TPU compiler, and
        made XLA:CPU compute another optimizer state under automatic FSDP: not
        used.)"""
        if self.memory_kind("optimizer") is None:
            return opt_state
        mesh = self.plan.mesh
        return jax.tree.map(
            lambda spec, x: (
                x if spec is None else jax.device_put(x, NamedSharding(mesh, spec, memory_kind="device"))
            ),
            self.opt_state,
            opt_state,
            is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
        )

    def onto_device(self, state: Any) -> Any:
        """Inside the compiled step: the offloaded parts of `state` (the array part
        of a `TrainState`, None elsewhere, with this layout's `state_shardings`)
        moved to the device's memory."""
        return self._moved(state, "device")

    @property
    def streams_stacked_params(self) -> bool:
        """Whether the passes leave an offloaded model's stacked weights in host
        memory and the stack's scan brings one layer's slice at a time onto the
        device (`streams_stacked_params_on` the mesh's platform)."""
        return self.streams_stacked_params_on(mesh_platform(self.plan.mesh))

    def streams_stacked_params_on(self, platform: str) -> bool:
        """`streams_stacked_params` on devices of `platform` (the advisor asks it
        of a device profile's): `ParallelDims.streams_stacked_params_on`."""
        return self.resolved.dims.streams_stacked_params_on(platform)

    def stacked_params_onto_device(self, model: PyTree) -> PyTree:
        """Inside the compiled step, once the gradients exist: the weights of an
        offloaded model's scanned stacks (`eqxpar.nn.Stacked`) moved to the
        device's memory for the update. `onto_device` leaves them in host memory
        for the forward and backward passes, where the stack's scan moves one
        layer's slice at a time (so the passes never hold the whole stack on the
        device). The same for the gradients (a model-shaped tree)."""
        if not self.streams_stacked_params:
            return model
        return _moved_leaves(model, self.params, self.plan.mesh, "device", stacks=True)

    def onto_host(self, state: Any) -> Any:
        """Inside the compiled step: the offloaded parts of `state` moved back to host memory."""
        return self._moved(state, HOST_MEMORY)

    def _moved(self, state: Any, kind: str) -> Any:
        if not self.resolved.dims.offload:
            return state
        specs = self.state_specs(state)
        mesh = self.plan.mesh
        parts = [("params", lambda s: s.model), ("optimizer", lambda s: s.opt_state)]
        for part, where in parts:
            # The optimizer state comes onto the device after the gradients
            # (`optimizer_state_onto_device`), not here.
            if self.memory_kind(part) is None or (part == "optimizer" and kind == "device"):
                continue
            # The stacks' weights stay in host memory for the passes: the stack's
            # scan brings each layer's slice over (`stacked_params_onto_device`
            # brings them whole for the update).
            stacks = False if part == "params" and kind == "device" and self.streams_stacked_params else None
            moved = _moved_leaves(where(state), where(specs), mesh, kind, stacks=stacks)
            state = eqx.tree_at(where, state, moved, is_leaf=lambda x: x is None)
        return state

    def shardings(self, specs: PyTree) -> PyTree:
        """`specs` (PartitionSpecs, None elsewhere) as NamedShardings on the plan's mesh."""
        return shardings_of(specs, self.plan.mesh)


def _moved_leaves(tree: PyTree, specs: PyTree, mesh: Any, kind: str, *, stacks: bool | None) -> PyTree:
    """`tree`'s arrays (those with a PartitionSpec in `specs`) moved to memory
    `kind`: all of them (`stacks=None`), only those inside an
    `eqxpar.nn.Stacked` (`True`) or only those outside one (`False`)."""

    def move(spec: Any, x: Any) -> Any:
        if spec is None:
            return x
        return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=kind))

    def node(spec: Any, x: Any) -> Any:
        if isinstance(spec, OrderedStack):
            if stacks is False:
                return x
            return jax.tree.map(move, spec, x, is_leaf=lambda v: v is None or isinstance(v, PartitionSpec))
        if stacks is True:
            return x
        return move(spec, x)

    return jax.tree.map(
        node, specs, tree, is_leaf=lambda v: v is None or isinstance(v, (PartitionSpec, OrderedStack))
    )


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Where `eqxpar.models.generate`'s arrays live under a plan, resolved once
    (the decoding counterpart of `StepLayout`).

    Build one with `DecodeLayout.resolve(ResolvedPlan.of(plan), batch)`, which refuses the plans
    decoding cannot serve (pipelines, context and expert parallelism, a batch the
    batch axes do not divide) with an error naming one that can.

    **Fields:**

    - `plan`: the plan decoding runs under: the given one with sequence
      parallelism and ring overlap off (one token has no sequence to split; the
      weights' layout is the same).
    - `manual`: whether each step runs inside `shard_map` (`mode="manual"`).
    - `manual_axes`: the axes of that `shard_map` (None: all of them).
    - `batch_axes`: the axes the batch, and the cache's batch, are split over.

    ```python
    layout = eqxpar.internal.DecodeLayout.resolve(eqxpar.internal.ResolvedPlan.of(plan), batch=8)
    layout.cache_spec("tensor")    # the cache's spec, heads over "tensor"
    ```
    """

    plan: Plan
    manual: bool
    manual_axes: tuple[str, ...] | None
    batch_axes: tuple[str, ...]

    @classmethod
    def resolve(cls, resolved: ResolvedPlan, batch: int) -> "DecodeLayout":
        """The layout of decoding `batch` rows under `resolved` (the plan resolved once, in `generate`)."""
        dims = resolved.dims
        serves = "eqxpar.Plan(eqxpar.make_mesh(data=..., tensor=...), rules=eqxpar.rules.MEGATRON)"
        if dims.pipelined:
            raise PlanError(
                f"generate under a pipeline plan (schedule={dims.schedule!r}): decoding one token at a "
                f"time through pipeline stages leaves all but one stage idle. Generate under a plan "
                f"without pipe, e.g. {serves}, or on one device with eqxpar.nn.in_natural_order(model)."
            )
        if dims.context_size > 1:
            raise PlanError(
                f"generate under context parallelism (mesh axis {CONTEXT_AXIS!r} of size "
                f"{dims.context_size}): the cache is not split along the sequence. Generate under a "
                f"plan whose mesh has no context axis, e.g. {serves} (long contexts: the cache's "
                "heads split over tensor)."
            )
        if dims.expert_size > 1:
            raise PlanError(
                f"generate under expert parallelism (mesh axis {EXPERT_AXIS!r} of size "
                f"{dims.expert_size}): not supported. Generate under a plan without an expert axis "
                f"(data and tensor), e.g. {serves}."
            )
        if batch % dims.batch_size_multiple:
            raise BatchError(
                f"generate: a batch of {batch} prompts under a plan whose batch axes {dims.batch_axes} "
                f"split it over {dims.batch_size_multiple} devices. Pass a multiple of "
                f"{dims.batch_size_multiple} prompts (pad with copies)."
            )
        decode = dataclasses.replace(resolved.plan, sequence_parallel=False, tp_overlap=False)
        return cls(decode, dims.mode == "manual", dims.manual_axes, dims.batch_axes)

    def cache_spec(self, heads: Any) -> PartitionSpec:
        """The spec of a key or value cache `(layers, blocks per layer, batch, slots,
        kv_heads, head_dim)`: batch over the batch axes, heads as `heads` (the spec
        entry of the attention's key heads under the plan's rules)."""
        return PartitionSpec(None, None, self.batch_axes or None, None, heads, None)

    def check_weights(self, specs: PyTree) -> None:
        """Refuse, in manual mode, weights split over a manual batch axis (FSDP):
        a decode step would need every layer gathered by hand."""
        if not self.manual:
            return
        mesh = self.plan.mesh
        manual = region_manual_axes(mesh, mesh.axis_names if self.manual_axes is None else self.manual_axes)
        split = {a for a in self.batch_axes if a in manual and mesh.shape[a] > 1}
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        named = {
            a for spec in jax.tree.leaves(specs, is_leaf=is_spec) for e in spec for a in mesh_axis_names(e)
        }
        if named & split:
            raise PlanError(
                f"generate under a manual plan whose rules split weights over the batch axes "
                f"{sorted(named & split)} (FSDP): a decode step would need every layer gathered by "
                "hand. Generate under the same plan in automatic mode: dataclasses.replace(plan, "
                "mode='auto')."
            )
