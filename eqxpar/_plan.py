"""The plan: one frozen object that says how a training step is parallelised."""

import contextvars
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._batch_layout import BatchLayout
from ._errors import AxisNameError, DivisibilityError, PlanError
from ._mesh import BATCH_AXES, CONTEXT_AXIS, EXPERT_AXIS
from ._remat import RematPolicy, checked_offload
from ._rules import Rule, as_rules, as_spec, mesh_axis_names
from ._stack_order import StackOrder, pipeline_order
from ._text import short

# `with plan:` blocks nest per thread; the tokens to restore live beside the value.
_TOKENS = threading.local()
_CURRENT: contextvars.ContextVar["Plan | None"] = contextvars.ContextVar("eqxpar_plan", default=None)

Mode = Literal["auto", "manual"]

#: Rematerialisation policies of scanned stacks (`eqxpar.nn.Stacked`), from most
#: memory to least: keep everything; keep matmul results; keep each block's input
#: only; keep only the stack's input (the whole stack is recomputed once in the
#: backward pass, and each block once more inside that).
REMAT_POLICIES = ("none", "dots", "inputs", "full")

#: How attention moves keys and values under context parallelism
#: (`Plan(context_attention=...)`, `eqxpar.nn.context_attention`).
CONTEXT_ATTENTION = ("ring", "allgather", "ulysses")

#: Pipeline schedules (`eqxpar.pipeline.schedule`, `Plan(schedule=...)`).
#: How a pipeline step holds FSDP-split weights and their gradients
#: (`Plan(stage_gradients=...)`).
STAGE_GRADIENTS = ("whole", "sharded")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zb_v", "dualpipe_v")
#: The schedules of a V placement: two chunks per device, device d holding
#: virtual stages d and 2p-1-d (so device 0 runs both the first and the last).
V_SCHEDULES = ("zb_v", "dualpipe_v")
#: Schedule tables `eqxpar.pipeline.schedule` builds for prediction only, which
#: the engine does not run: none (ZB-V and DualPipeV once were).
PREDICTION_SCHEDULES: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, init=False)
class Plan:
    """How a model is laid out on a mesh and how its step is run.

    **Arguments:**

    - `mesh`: the device mesh (usually from `eqxpar.make_mesh`).
    - `rules`: a rule or sequence of rules (`eqxpar.rules`) mapping weights to
      PartitionSpecs; first match wins, unclaimed weights are replicated. The
      default (no rules) replicates every weight: data parallelism.
    - `batch_axes`: mesh axes (one name or a sequence of names) the batch's leading
      dimension is split over; default the mesh's `data` and `fsdp` axes, and
      `expert` when it is larger than 1.
    - `annotations`: name -> PartitionSpec for `eqxpar.annotate(x, name)`. Defaults:
      `"batch"` and `"activations"` both split the leading dimension over
      `batch_axes`; entries given here override them.
    - `mode`: `"auto"` (the default) compiles the step with `jax.jit` and lets the
      compiler (GSPMD) insert collectives; `"manual"` runs the per-device step
      inside `jax.shard_map`, with eqxpar issuing the collectives itself. Pipeline
      plans (`schedule=`) take no mode: they always run manual.
    - `sequence_parallel`: tensor-parallel layers keep the activations between
      blocks split along the sequence over `tensor_axis` (all-gather before a
      column-parallel layer, reduce-scatter after a row-parallel one, norms on
      sequence shards) instead of replicated.
    - `tp_overlap`: in manual mode (required), tensor-parallel layers overlap their
      all-gather / reduce-scatter with the matmul as ring `ppermute` collective
      matmuls. Needs `sequence_parallel=True` (the ring splits the sequence).
    - `tensor_axis`: the mesh axis tensor-parallel layers split over.
    - `context_attention`: how attention moves keys and values when the mesh's
      `context` axis is larger than 1 (context parallelism): `"ring"` (the
      default: `ppermute` around the ring, each transfer overlapping a block's
      compute; not in pipelines), `"allgather"` (one gather of K/V per layer;
      the default in pipelines, whose stages run in branches where a ring's
      permutes, which rendezvous across every device on XLA:CPU, would hang) or
      `"ulysses"` (all-to-alls turn the sequence split of q, k, v into a split of
      the heads, attention runs over the whole sequence for `heads / n` heads,
      and an all-to-all brings the output back: `8 (n-1)/n` of a local q's bytes
      per layer against the ring's `6 (n-1)` for multi-head attention, but every
      device's query heads, after any tensor split, must be a multiple of the
      `context` size (the step raises a `PlanError` naming the fix otherwise),
      key/value heads fewer than that are repeated, and a tensor axis must be
      manual: `mode="manual"`). Context
      parallelism itself needs no flag: a `context` axis of size `n > 1` splits
      the sequence of every activation into `n` load-balanced parts (device `i`
      holds chunks `i` and `2n-1-i` of `2n`). The step runs manual over
      `context` in every mode (in `mode="auto"` a partial-manual region over it),
      the batch is replicated over it, eqxpar's layers take this device's part
      of the ids, positions and labels themselves (`eqxpar.nn.split_sequence`),
      attention runs `eqxpar.nn.context_attention`, and the loss (a mean over
      this device's tokens) is averaged over `context` as over the batch axes.
      Expert parallelism needs no flag either: a mesh `expert` axis of size
      `n > 1` is a batch axis (it must be one of `batch_axes`), the step runs
      manual over it in every mode, weights whose `experts` dimension a rule
      splits over it (`rules.Logical({"experts": "expert"})`, or the
      ready-made `rules.EXPERT` / `rules.MEGATRON` ones) stay split (each device
      holds `1/n` of the experts and of their optimizer state; no gather), and
      every `eqxpar.nn.MoE` layer sends each token to the device holding its
      expert and back with all-to-alls over it.
    - `manual_axes`: with `mode="manual"`, the mesh axes the per-device step is
      manual over (default None: all of them). Naming a subset, e.g. `("tensor",)`,
      gives a partial-manual step: eqxpar issues the tensor-parallel collectives
      inside `shard_map` while the other axes stay automatic, so the compiler
      splits the batch over `data` and reduces its gradients there.
    - `remat`: what a scanned stack (`eqxpar.nn.Stacked`) keeps for the backward
      pass, per block: `"none"` (everything), `"dots"` (matmul outputs; the rest
      is recomputed), `"inputs"` (nothing but each block's input; the block is
      recomputed), `"full"` (nothing but the stack's input: the forward pass is
      recomputed once more, keeping block inputs, then each block as in
      `"inputs"`). Under a pipeline, every policy but `"full"` also keeps each
      stage forward's residuals (by this policy) for its backward actions;
      `"full"` keeps the stage input only and recomputes the stage forward in
      each backward action. An `eqxpar.RematPolicy` instead keeps (or, with
      `offload=("activations",)`, moves to host memory) the intermediate values
      it names (`eqxpar.ACTIVATION_NAMES`: each block's input, the attention's
      projections, the MLP's) and recomputes the rest.
    - `offload`: what lives in host memory (`"pinned_host"`) instead of the
      device's, any of `"optimizer"` (the optimizer state: the update streams
      it through the device a layer at a time, each chunk read from host memory
      and the new one written back, where the update is elementwise; otherwise,
      and on XLA:CPU, the whole state comes to the device for the update),
      `"params"` (the
      parameters: moved to the device inside the step, the updated ones back)
      and `"activations"` (the activations `remat`'s `RematPolicy` names as
      offloaded: copied to the host in the forward pass, back in the backward
      pass). Default `()`: everything on the device. The step moves what it needs
      inside the compiled program. XLA:CPU ignores activation offload (it keeps
      them on the device, as saved): a step built for a CPU mesh warns
      (`eqxpar.OffloadWarning`).
    - `schedule`: run the step as a pipeline over mesh axis `pipe` with this
      schedule (`"gpipe"`, `"1f1b"`, `"interleaved"`, `"zero_bubble"`, `"zb_v"`,
      `"dualpipe_v"` (the last two in a V placement: two chunks per device,
      device `d` holding virtual stages `d` and `2 pipe - 1 - d`), or an
      `eqxpar.pipeline.Schedule` object such as a custom table from
      `Schedule.from_table` / `Schedule.from_orders`, whose stages must equal the
      `pipe` size and which then sets `microbatches` and `chunks`; see
      `eqxpar.pipeline`); the loss must be an `eqxpar.pipeline.PipelineLoss`.
      None (default): no pipeline.
    - `microbatches`: micro-batches each pipeline step splits the batch into
      (pipeline plans only; gradient accumulation is `make_step(accumulate=...)`).
    - `chunks`: virtual stages per device (`schedule="interleaved"`; `"zb_v"` and
      `"dualpipe_v"` always run 2, implied when left out).
    - `stage_layers`: layers per virtual stage, in pipeline order (virtual stage
      `k` runs on device `k % pipe` as its chunk `k // pipe`; in a V placement
      device `d` runs stages `d` and `2 pipe - 1 - d`): `pipe * chunks`
      positive integers summing to the stack's depth, e.g. `(3, 4, 4, 3)` to give
      the first and last stages, which also run the embedding and the head, a
      layer less. None (default): `depth / (pipe * chunks)` layers each. Every
      device stores `chunks * max(stage_layers)` layer slots (a device's arrays
      must have one shape on every device), the slots a stage does not run
      holding zeros that get zero gradients and cost no FLOPs. The plan owns
      that storage order (`Plan.stack_order`): `eqxpar.train.init`,
      `eqxpar.shard`, `from_pretrained(path, plan)` and a checkpoint restore
      store a natural-order stack in it, and the stack records it, so that
      `save_pretrained`, checkpoints and calling the model outside the pipeline
      see the natural order again; no user code reorders layers.
    - `stage_gradients`: under a pipeline whose rules split weights over the
      batch axes (FSDP, e.g. `stage_rules(rules.FSDP())`), how a device holds its
      stage's weights and gradients during the step. `"whole"` (the default):
      gathered once before the schedule's loops and reduce-scattered once after
      them, so each weight crosses the wire the fewest times, but the device holds
      its stage's weights and float32 gradient sums whole (gathered over the batch
      axes) for the whole step: `2 x 4` bytes per parameter of the stage.
      `"sharded"`: every weight is gathered where it is used, a layer at a time
      inside the stage's layer scan (one layer whole at a time), and each
      action's gradient reduce-scattered into sums kept split like the weights:
      the stage's memory falls by the FSDP size, while the weights cross the
      wire once per micro-batch and use rather than once per step (see
      `eqxpar.inspect.minimum_comm`). Choose `"sharded"` when the stage's whole
      weights and gradients would not fit a device (Llama-3-70B over pipe 4 x
      fsdp 32: 69 GB of float32 stage gradients per chip whole, 2 GB sharded).
      Needs a remat policy other than `"none"` (which would keep every layer's
      gathered weights for the backward actions).
    - `zero1`: ZeRO-1: parameters stay as the rules place them (typically
      replicated) while the optimizer state is split over `batch_axes`; each step
      reduce-scatters the gradients, updates the parameter shards and all-gathers
      the new parameters.
    - `param_dtype`: the dtype of the stored (master) parameters and hence of the
      optimizer state; `train.init` casts floating-point weights to it. None:
      leave the model's dtypes.
    - `compute_dtype`: the dtype the loss is computed in: floating-point weights
      and batch leaves are cast to it inside the step (e.g. `jnp.bfloat16`);
      gradients come back in the parameters' dtype. None: no cast.
    - `reduce_dtype`: the dtype gradients are reduced in over the data-parallel
      devices in manual steps (default: the parameters' dtype). Automatic steps
      reduce wherever the compiler puts the reduction, in the dtype it has there,
      so a step that reduces nothing by hand (see `StepLayout.reduced_axes`)
      refuses the option rather than ignore it.

    Validated when built: every mesh axis named by a rule or annotation must exist,
    an option of the wrong kind (`rules=3`, `batch_axes=3`, an annotation that
    is not a spec) raises an `EqxparError` naming it, and so does an option the
    plan would ignore (`mode` with `schedule`, `tp_overlap` without
    `mode="manual"`). The fields hold what was asked (`mode=None`,
    `manual_axes=None` for the defaults; `annotations` only the given ones), so
    `dataclasses.replace(plan, ...)` builds the plan those arguments describe.
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
    mode: Mode | None
    sequence_parallel: bool
    tp_overlap: bool
    tensor_axis: str
    context_attention: str | None
    manual_axes: tuple[str, ...] | None
    remat: Any  # str | RematPolicy
    offload: tuple[str, ...]
    schedule: Any  # str | eqxpar.pipeline.Schedule | None
    microbatches: int
    chunks: int
    stage_layers: tuple[int, ...] | None
    stage_gradients: str
    zero1: bool
    param_dtype: Any
    compute_dtype: Any
    reduce_dtype: Any

    def __init__(
        self,
        mesh: Mesh,
        *,
        # `Any` for the options validated below: a wrong kind of value raises an
        # eqxpar error naming it and the fix (see the docstring for what each takes).
        rules: Any = None,
        batch_axes: Any = None,
        annotations: Any = None,
        mode: str | None = None,
        sequence_parallel: bool = False,
        tp_overlap: bool = False,
        tensor_axis: str = "tensor",
        context_attention: str | None = None,
        manual_axes: Any = None,
        remat: Any = "none",
        offload: Any = (),
        schedule: Any = None,
        microbatches: int = 1,
        chunks: int = 1,
        stage_layers: Any = None,
        stage_gradients: str = "whole",
        zero1: bool = False,
        param_dtype: Any = None,
        compute_dtype: Any = None,
        reduce_dtype: Any = None,
    ):
        _check_mesh(mesh)
        names = tuple(mesh.axis_names)
        rules = _checked_rules(rules, names)
        batch_axes = _checked_axes(
            _default_batch_axes(mesh) if batch_axes is None else batch_axes,
            "batch_axes",
            names,
        )
        _check_expert(mesh, batch_axes, tensor_axis)
        _check_tensor_axis(tensor_axis, names)
        _check_tensor_not_batch(rules, batch_axes, tensor_axis, mesh, sequence_parallel or tp_overlap)
        if manual_axes is not None:
            manual_axes = _checked_manual_axes(manual_axes, mode, schedule, names)
        _check_context(mesh, batch_axes, manual_axes, context_attention, schedule)
        _check_expert_manual(mesh, manual_axes)
        mode = _checked_mode(mode, schedule, tp_overlap, sequence_parallel)
        _check_ulysses(mesh, context_attention, mode, manual_axes, tensor_axis)
        _check_remat(remat)
        offload = checked_offload(offload, remat)
        microbatches, chunks = _check_pipeline(schedule, microbatches, chunks, mesh)
        stage_layers = _checked_stage_layers(stage_layers, schedule, mesh, chunks)
        _check_stage_gradients(stage_gradients, schedule, remat)
        values = dict(
            mesh=mesh,
            rules=rules,
            batch_axes=batch_axes,
            annotations=_checked_annotations(annotations, names),
            mode=mode,
            sequence_parallel=bool(sequence_parallel),
            tp_overlap=bool(tp_overlap),
            tensor_axis=tensor_axis,
            context_attention=context_attention,
            manual_axes=manual_axes,
            remat=remat,
            offload=offload,
            schedule=schedule,
            microbatches=microbatches,
            chunks=chunks,
            stage_layers=stage_layers,
            stage_gradients=stage_gradients,
            zero1=bool(zero1),
            param_dtype=_checked_dtype(param_dtype, "param_dtype"),
            compute_dtype=_checked_dtype(compute_dtype, "compute_dtype"),
            reduce_dtype=_checked_dtype(reduce_dtype, "reduce_dtype"),
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def batch_layout(self) -> BatchLayout:
        """How this plan splits a batch (`BatchLayout`): the one home of the batch
        spec and the data-parallel size, which the properties below delegate to."""
        pipelined = self.schedule is not None
        microbatches = self.microbatches if pipelined else 1
        return BatchLayout(self.mesh, tuple(self.batch_axes), pipelined, microbatches)

    @property
    def batch_size_multiple(self) -> int:
        """Number of devices the batch is split over (the data-parallel size; `batch_layout.blocks`)."""
        return self.batch_layout.blocks

    @property
    def context_size(self) -> int:
        """Number of devices the sequence is split over (the mesh's `context` axis; 1 if none)."""
        return int(self.mesh.shape.get(CONTEXT_AXIS, 1))

    @property
    def expert_size(self) -> int:
        """Number of devices the experts are split over (the mesh's `expert` axis; 1 if none)."""
        return int(self.mesh.shape.get(EXPERT_AXIS, 1))

    @property
    def batch_spec(self) -> PartitionSpec:
        """The PartitionSpec of a batch leaf: leading dimension over `batch_axes` (`batch_layout.spec`)."""
        return self.batch_layout.spec

    @property
    def optimizer_rules(self) -> tuple[Rule, ...]:
        """The rules that place the optimizer state: the parameters' rules, or
        under `zero1` those plus a split over `batch_axes` (see `rules.ZeroShard`)."""
        if not self.zero1:
            return self.rules
        from ._rules import ZeroShard

        return (ZeroShard(self.rules, axis=self.batch_axes),)

    @property
    def annotation_specs(self) -> dict[str, PartitionSpec]:
        """Every annotation name -> spec: the defaults (`"batch"` and
        `"activations"` over `batch_axes`) overridden by `annotations`."""
        batch = self.batch_layout.spec
        return {"batch": batch, "activations": batch, **dict(self.annotations)}

    def annotation(self, name: str) -> PartitionSpec | None:
        """The spec registered for annotation `name`, or None."""
        return self.annotation_specs.get(name)

    def stack_order(self, depth: int) -> StackOrder | None:
        """The order this plan stores a scanned stack of `depth` layers in (the
        plan owns it: `train.init`, `eqxpar.shard`, `from_pretrained` and a
        checkpoint restore apply it, and every way out undoes it): None for the
        natural order (no pipeline, or one stage per device with equal stages),
        else the pipeline's `StackOrder` (interleaved chunks, uneven
        `stage_layers`). Raises `DivisibilityError` / `PlanError` where `depth`
        does not fit the pipeline."""
        if self.schedule is None:
            return None
        stages = self.mesh.shape["pipe"]
        if self.stage_layers is not None:
            checked_stage_layers(self.stage_layers, stages=stages, chunks=self.chunks, depth=depth)
        elif depth % (stages * self.chunks):
            raise DivisibilityError(
                f"a stack of depth {depth} does not split into {stages} stages x {self.chunks} chunks "
                f"of the plan's pipeline; use a depth that is a multiple of {stages * self.chunks}, or "
                "give the layers per virtual stage (Plan(stage_layers=...))."
            )
        return pipeline_order(
            depth, stages=stages, chunks=self.chunks, stage_layers=self.stage_layers, placement=self.placement
        )

    @property
    def placement(self) -> str | None:
        """Where the pipeline's virtual stages run (`eqxpar._stack_order.PLACEMENTS`):
        `"v"` for the V schedules (`"zb_v"`, `"dualpipe_v"`, or a `Schedule` of V
        placement: device `d` holds stages `d` and `2 pipe - 1 - d`), `"loop"` for
        the others (virtual stage `k` on device `k % pipe`); None without a pipeline."""
        if self.schedule is None:
            return None
        if self.schedule in V_SCHEDULES or getattr(self.schedule, "placement", None) == "v":
            return "v"
        return "loop"

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """A `NamedSharding` of `spec` on this plan's mesh."""
        return NamedSharding(self.mesh, spec)

    def __enter__(self) -> "Plan":
        _TOKENS.stack = getattr(_TOKENS, "stack", [])
        _TOKENS.stack.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.reset(_TOKENS.stack.pop())


def _check_mesh(mesh: Any) -> None:
    """`Plan(mesh=...)` is a mesh (anything else fails later, far from the cause)."""
    if not isinstance(mesh, Mesh):
        raise PlanError(
            f"Plan(mesh={mesh!r}): expected a jax.sharding.Mesh; build one with "
            "eqxpar.make_mesh(data=..., fsdp=..., tensor=..., pipe=...)."
        )


def _check_tensor_axis(tensor_axis: str, names: tuple[str, ...]) -> None:
    """`Plan(tensor_axis=...)` names an axis of the mesh (of axis names `names`)."""
    if tensor_axis not in names:
        raise AxisNameError(
            f"Plan(tensor_axis={tensor_axis!r}): the mesh has axes {names}, none of them "
            f"{tensor_axis!r}. Pass tensor_axis= one of those names, or build the mesh with "
            "eqxpar.make_mesh(data=..., tensor=...), which names every axis eqxpar uses "
            "(size 1 where unused)."
        )


def _check_expert_manual(mesh: Mesh, manual_axes: tuple[str, ...] | None) -> None:
    """Explicit `manual_axes` include the expert axis wherever it splits experts."""
    if manual_axes is not None and int(mesh.shape.get(EXPERT_AXIS, 1)) > 1 and EXPERT_AXIS not in manual_axes:
        raise PlanError(
            f"Plan(manual_axes={manual_axes!r}) leaves out {EXPERT_AXIS!r} (size "
            f"{mesh.shape[EXPERT_AXIS]}): expert parallelism sends tokens between its devices by "
            f"hand (all-to-all), so the step is always manual over it. Add {EXPERT_AXIS!r} to manual_axes."
        )


def _axis_names(value: Any, what: str) -> tuple[str, ...]:
    """`Plan(<what>=value)` as a tuple of axis names: one name, or a sequence of
    distinct names."""
    if isinstance(value, str):
        return (value,)
    if not (isinstance(value, Sequence) and all(isinstance(a, str) for a in value)):
        raise AxisNameError(
            f"Plan({what}={short(value)}): expected a mesh axis name or a sequence of them, "
            f"e.g. {what}=('data', 'fsdp')."
        )
    axes = tuple(value)
    if len(set(axes)) != len(axes):
        raise AxisNameError(
            f"Plan({what}={axes!r}) names an axis twice; a dimension is split over each "
            "axis at most once. Name each axis once."
        )
    return axes


def _checked_rules(rules: Any, names: tuple[str, ...]) -> tuple[Rule, ...]:
    rules = as_rules(rules)
    for rule in rules:
        declared = getattr(rule, "mesh_axes", None)
        for axis in sorted(declared() if declared else ()):
            if axis not in names:
                raise AxisNameError(
                    f"rule {rule!r} names mesh axis {axis!r}, but the mesh has axes "
                    f"{names}. Use one of those names."
                )
    return rules


def _checked_axes(value: Any, what: str, names: tuple[str, ...]) -> tuple[str, ...]:
    axes = _axis_names(value, what)
    for axis in axes:
        if axis not in names:
            raise AxisNameError(
                f"Plan({what}={axes!r}) names mesh axis {axis!r}, but the mesh has axes "
                f"{names}. Use some of those names."
            )
    return axes


def _checked_annotations(annotations: Any, names: tuple[str, ...]) -> tuple[tuple[str, PartitionSpec], ...]:
    # Only what the user gave is stored (the defaults follow batch_axes, see
    # `Plan.annotation_specs`), as sorted pairs, which `Plan(annotations=...)`
    # takes back: `dataclasses.replace(plan, ...)` rebuilds the same plan.
    pairs = annotations
    if isinstance(annotations, Mapping):
        pairs = tuple(annotations.items())
    elif annotations is None:
        pairs = ()
    elif not (
        isinstance(annotations, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in annotations)
    ):
        raise PlanError(
            f"Plan(annotations={short(annotations)}): expected a dict of annotation name -> "
            "PartitionSpec, e.g. annotations={'activations': P('data', None, 'tensor')}."
        )
    table = {}
    for key, spec in pairs:
        if not isinstance(key, str):
            raise PlanError(
                f"Plan(annotations=...): key {short(key)} is not a name; expected the str "
                "names passed to eqxpar.annotate(x, name), e.g. 'activations'."
            )
        spec = as_spec(spec, where=f"Plan(annotations=...) entry {key!r}")
        for entry in spec:
            for axis in mesh_axis_names(entry):
                if axis not in names:
                    raise AxisNameError(
                        f"annotation {key!r} -> {spec} names mesh axis {axis!r}, but "
                        f"the mesh has axes {names}. Use one of those names."
                    )
        table[key] = spec
    return tuple(sorted(table.items()))


def _checked_mode(mode: Any, schedule: Any, tp_overlap: Any, sequence_parallel: Any) -> Mode | None:
    # None: not chosen. A pipeline runs its own engine, manual over every axis,
    # so it takes no mode; any other plan defaults to "auto".
    if tp_overlap and not sequence_parallel:
        raise PlanError(
            "Plan(tp_overlap=True) needs sequence_parallel=True: the ring collective "
            "matmuls pass sequence blocks around the tensor axis. Set sequence_parallel=True."
        )
    if schedule is not None:
        if mode is not None:
            raise PlanError(
                f"Plan(mode={mode!r}, schedule={schedule!r}): a pipeline step always runs manual over "
                "every mesh axis, so mode would be ignored. Drop mode (mode=None)."
            )
        return None
    mode = "auto" if mode is None else mode
    if mode not in ("auto", "manual"):
        raise PlanError(f"Plan(mode={mode!r}): expected 'auto' or 'manual'.")
    if tp_overlap and mode != "manual":
        raise PlanError(
            "Plan(tp_overlap=True) needs mode='manual': the ring collective matmuls are eqxpar's own "
            "ppermutes, issued where the tensor axis is manual; under mode='auto' the compiler places "
            "the collectives and the flag would be ignored. Set mode='manual', or drop tp_overlap."
        )
    return mode


def _checked_manual_axes(
    manual_axes: Any, mode: Any, schedule: Any, names: tuple[str, ...]
) -> tuple[str, ...]:
    if schedule is not None:
        raise PlanError(
            f"Plan(schedule={schedule!r}, manual_axes={manual_axes!r}): a pipeline step runs manual "
            "over every mesh axis. Drop manual_axes."
        )
    if mode != "manual":
        raise PlanError(
            f"Plan(manual_axes={manual_axes!r}) needs mode='manual'; in mode='auto' "
            "every axis is automatic. Set mode='manual' or drop manual_axes."
        )
    axes = _checked_axes(manual_axes, "manual_axes", names)
    if not axes:
        raise PlanError("Plan(manual_axes=()): name at least one axis, or use mode='auto'.")
    return tuple(a for a in names if a in set(axes))


def _checked_dtype(dtype: Any, what: str) -> Any:
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise PlanError(f"Plan({what}={dtype!r}): not a dtype; use e.g. jnp.bfloat16.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise PlanError(f"Plan({what}={dtype}): expected a floating-point dtype (float32, bfloat16, ...).")
    return dtype


def _check_tensor_not_batch(
    rules: tuple[Rule, ...], batch_axes: tuple[str, ...], tensor_axis: str, mesh: Mesh, sequence: bool
) -> None:
    # Tensor-parallel activations are (batch, seq, features) with the batch over
    # `batch_axes` and the features (or, sequence parallel, the sequence) over the
    # tensor axis: one mesh axis cannot split two dimensions of one array.
    # (Even at size 1: a spec may not name one axis twice.)
    if tensor_axis not in batch_axes:
        return
    declared = set()
    for rule in rules:
        found = getattr(rule, "mesh_axes", None)
        declared |= set(found() if found else ())
    if sequence or tensor_axis in declared:
        raise PlanError(
            f"Plan(batch_axes={batch_axes!r}) splits the batch over the tensor axis {tensor_axis!r} "
            f"(size {mesh.shape[tensor_axis]}), which tensor-parallel activations are also split over "
            f"(the plan's {'sequence parallelism' if sequence else 'rules'} use it). Drop {tensor_axis!r} from batch_axes, or give the tensor-parallel "
            "layers another axis (Plan(tensor_axis=...))."
        )


def _default_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    # `expert` joins only when it splits something: at size 1 the batch spec
    # stays P(("data", "fsdp")), as on meshes without expert parallelism.
    names = tuple(mesh.axis_names)
    return tuple(a for a in BATCH_AXES if a in names and (a != EXPERT_AXIS or mesh.shape[a] > 1))


def _check_expert(mesh: Mesh, batch_axes: tuple[str, ...], tensor_axis: str) -> None:
    n = int(mesh.shape.get(EXPERT_AXIS, 1))
    if n == 1:
        return
    if EXPERT_AXIS not in batch_axes:
        raise PlanError(
            f"Plan(batch_axes={batch_axes!r}) leaves out {EXPERT_AXIS!r} (size {n}): outside its "
            "mixture-of-experts layers every device of the expert axis computes on its own examples "
            "(without them it would repeat its neighbours' work, and the all-to-all dispatch would "
            f"send the same tokens n times). Add {EXPERT_AXIS!r} to batch_axes, or leave batch_axes "
            "at its default."
        )
    if tensor_axis == EXPERT_AXIS:
        raise PlanError(
            f"Plan(tensor_axis={EXPERT_AXIS!r}): the expert axis splits experts and the batch; "
            "tensor-parallel layers need their own axis. Use tensor_axis='tensor'."
        )


def _check_context(
    mesh: Mesh, batch_axes: tuple[str, ...], manual_axes: tuple[str, ...] | None, impl: Any, schedule: Any
) -> None:
    n = int(mesh.shape.get(CONTEXT_AXIS, 1))
    if impl is not None and impl not in CONTEXT_ATTENTION:
        raise PlanError(f"Plan(context_attention={impl!r}): expected one of {CONTEXT_ATTENTION}.")
    if impl is not None and n == 1:
        raise PlanError(
            f"Plan(context_attention={impl!r}) chooses how attention passes keys and values between "
            f"the devices of mesh axis {CONTEXT_AXIS!r}, but the mesh has no such axis larger than 1, "
            "so it would be ignored. Build the mesh with eqxpar.make_mesh(context=n), or drop the option."
        )
    if n == 1:
        return
    if impl == "ring" and schedule is not None:
        raise PlanError(
            f"Plan(context_attention='ring', schedule={schedule!r}): a pipeline runs each stage in a "
            "branch that only its devices take, and the ring's permutes would wait there for devices "
            "of other stages (a hang, then an abort). Use context_attention='allgather' (the default "
            "in pipelines)."
        )
    if CONTEXT_AXIS in batch_axes:
        raise PlanError(
            f"Plan(batch_axes={batch_axes!r}) splits the batch over {CONTEXT_AXIS!r} (size {n}), the axis "
            "that splits the sequence (context parallelism). Drop it from batch_axes."
        )
    if manual_axes is not None and CONTEXT_AXIS not in manual_axes:
        raise PlanError(
            f"Plan(manual_axes={manual_axes!r}) leaves out {CONTEXT_AXIS!r} (size {n}): context "
            "parallelism passes keys and values between its devices by hand, so the step is always "
            f"manual over it. Add {CONTEXT_AXIS!r} to manual_axes."
        )


def _check_ulysses(mesh: Mesh, impl: Any, mode: Mode | None, manual_axes: Any, tensor_axis: str) -> None:
    t = int(mesh.shape.get(tensor_axis, 1))
    if impl != "ulysses" or t == 1 or mode is None:
        return
    if mode == "manual" and (manual_axes is None or tensor_axis in manual_axes):
        return
    raise PlanError(
        f"Plan(context_attention='ulysses', mode={mode!r}"
        f"{'' if manual_axes is None else f', manual_axes={manual_axes!r}'}): Ulysses splits each "
        f"device's attention heads over {CONTEXT_AXIS!r} by hand, and here the compiler splits the "
        f"heads over the automatic tensor axis {tensor_axis!r} (size {t}) too, which the all-to-all "
        f"cannot cut by hand. Use mode='manual' (with {tensor_axis!r} among manual_axes), or "
        "context_attention='ring' / 'allgather'."
    )


def _check_remat(remat: Any) -> None:
    if not isinstance(remat, RematPolicy) and remat not in REMAT_POLICIES:
        raise PlanError(f"Plan(remat={remat!r}): expected one of {REMAT_POLICIES} or an eqxpar.RematPolicy.")


def _checked_stage_layers(stage_layers: Any, schedule: Any, mesh: Mesh, chunks: int) -> Any:
    if stage_layers is None:
        return None
    if schedule is None:
        raise PlanError(
            f"Plan(stage_layers={stage_layers!r}) needs a pipeline schedule: set schedule= "
            f"one of {PIPELINE_SCHEDULES}, or leave stage_layers out."
        )
    return checked_stage_layers(stage_layers, stages=mesh.shape["pipe"], chunks=chunks)


def _check_stage_gradients(value: Any, schedule: Any, remat: Any) -> None:
    if value not in STAGE_GRADIENTS:
        raise PlanError(f"Plan(stage_gradients={value!r}): expected one of {STAGE_GRADIENTS}.")
    if value == "whole":
        return
    if schedule is None:
        raise PlanError(
            f"Plan(stage_gradients={value!r}) says how a pipeline holds its stages' FSDP gradients, "
            f"but the plan has no schedule: set schedule= one of {PIPELINE_SCHEDULES}, or leave "
            "stage_gradients out (a step without a pipeline gathers FSDP weights a layer at a time already)."
        )
    if remat == "none":
        raise PlanError(
            f"Plan(stage_gradients={value!r}, remat='none'): remat 'none' keeps each layer's gathered "
            "weights for the backward actions, one copy per micro-batch in flight, more than the whole "
            "stage the sharded sums save. Set remat='full' (or 'dots' / 'inputs'), or "
            "stage_gradients='whole'."
        )


def _check_pipeline(schedule: Any, microbatches: int, chunks: int, mesh: Mesh) -> tuple[int, int]:
    """Validate the pipeline options; returns `(microbatches, chunks)`, taken from
    the schedule when it is a `Schedule` object."""
    names = tuple(mesh.axis_names)
    for what, value in (("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"Plan({what}={value!r}): expected a positive integer.")
    if schedule is None:
        if microbatches != 1 or chunks != 1:
            raise PlanError(
                f"Plan(microbatches={microbatches}, chunks={chunks}) needs a pipeline schedule: set "
                f"schedule= one of {PIPELINE_SCHEDULES}. (Gradient accumulation without a pipeline is "
                "eqxpar.train.make_step(..., accumulate=k).)"
            )
        return microbatches, chunks
    # Imported here, not at the top: importing a module of eqxpar.pipeline runs
    # the package's __init__, which imports eqxpar.nn, whose layers import this
    # module. (No module of eqxpar.pipeline that this one imports imports it.)
    from .pipeline._schedule import Schedule

    if isinstance(schedule, Schedule):
        return _check_schedule_object(schedule, microbatches, chunks, mesh)
    if not isinstance(schedule, str) or schedule not in PIPELINE_SCHEDULES:
        raise PlanError(
            f"Plan(schedule={schedule!r}): unknown schedule; expected one of {PIPELINE_SCHEDULES}."
        )
    if "pipe" not in names:
        raise PlanError(
            f"Plan(schedule={schedule!r}) pipelines over mesh axis 'pipe', but the mesh has axes "
            f"{names}. Build the mesh with eqxpar.make_mesh(pipe=...)."
        )
    if schedule in V_SCHEDULES:
        return microbatches, _check_v(schedule, microbatches, chunks, mesh.shape["pipe"])
    if chunks > 1 and schedule != "interleaved":
        raise PlanError(
            f"Plan(schedule={schedule!r}, chunks={chunks}): only schedule='interleaved' runs several "
            "chunks (virtual stages) per device (and 'zb_v' and 'dualpipe_v' two, in a V). Use "
            "schedule='interleaved', or chunks=1."
        )
    return microbatches, chunks


def _check_v(schedule: str, microbatches: int, chunks: int, pipe: int) -> int:
    """The chunks of a V schedule (always 2: 1, the option's default, means "not
    given"), checked with its micro-batches."""
    if chunks not in (1, 2):
        raise PlanError(
            f"Plan(schedule={schedule!r}, chunks={chunks}): {schedule!r} runs two chunks per device in "
            "a V (device d holds virtual stages d and 2p-1-d). Leave chunks out or pass chunks=2."
        )
    if schedule == "dualpipe_v" and microbatches < 2 * pipe:
        raise PlanError(
            f"Plan(schedule='dualpipe_v', microbatches={microbatches}): DualPipeV needs at least 2 * "
            f"pipe = {2 * pipe} micro-batches on pipe={pipe}. Use microbatches >= {2 * pipe}, or "
            "schedule='zb_v'."
        )
    return 2


def _check_schedule_object(schedule: Any, microbatches: int, chunks: int, mesh: Mesh) -> tuple[int, int]:
    from .pipeline._validate import validate  # imported here: see `_check_pipeline`

    names = tuple(mesh.axis_names)
    if schedule.placement == "v" and schedule.chunks != 2:
        raise PlanError(
            f"Plan(schedule={schedule!r}): a table of V placement runs two chunks per device (device "
            f"d holds stages d and 2p-1-d), this one {schedule.chunks}. Build it with chunks=2, or "
            "with placement='interleaved'."
        )
    # Every error of the table before anything compiles.
    validate(schedule)
    if "pipe" not in names:
        raise PlanError(
            f"Plan(schedule={schedule!r}) pipelines over mesh axis 'pipe', but the mesh has axes "
            f"{names}. Build the mesh with eqxpar.make_mesh(pipe={schedule.stages})."
        )
    if mesh.shape["pipe"] != schedule.stages:
        raise PlanError(
            f"Plan(schedule={schedule!r}): the table has {schedule.stages} stages but the mesh's "
            f"'pipe' axis has {mesh.shape['pipe']} devices. Build the table for stages="
            f"{mesh.shape['pipe']}, or the mesh with pipe={schedule.stages}."
        )
    for what, given, own in (
        ("microbatches", microbatches, schedule.microbatches),
        ("chunks", chunks, schedule.chunks),
    ):
        # 1 is the option's default: "not given".
        if given not in (1, own):
            raise PlanError(
                f"Plan(schedule={schedule!r}, {what}={given}): the table has {what}={own}. Leave "
                f"{what} out (the table sets it) or pass {what}={own}."
            )
    return schedule.microbatches, schedule.chunks


def checked_stage_layers(
    stage_layers: Any, *, stages: int, chunks: int, depth: int | None = None
) -> tuple[int, ...]:
    """`stage_layers` (layers per virtual stage, `Plan(stage_layers=...)`) as a
    tuple, checked: `stages * chunks` positive integers, summing to `depth`
    when given. Shared with `eqxpar.pipeline` (its storage order and engine)."""
    where = f"stage_layers={stage_layers!r}"
    if isinstance(stage_layers, (str, bytes)) or not isinstance(stage_layers, Sequence):
        raise PlanError(
            f"{where}: expected a sequence of layers per virtual stage, one per stage x chunk "
            f"({stages} x {chunks} = {stages * chunks} numbers), e.g. a layer less on the first and "
            "last stages."
        )
    values = tuple(stage_layers)
    bad = [a for a in values if not isinstance(a, int) or isinstance(a, bool) or a < 1]
    if bad:
        raise PlanError(
            f"{where}: every virtual stage needs a positive integer number of layers, got {bad[0]!r}. "
            "A stage of no layers would only pass its input on: give it a layer, or use fewer stages."
        )
    if len(values) != stages * chunks:
        raise PlanError(
            f"{where}: {len(values)} numbers, but the pipeline has {stages} stages x {chunks} chunks "
            f"= {stages * chunks} virtual stages. Give one layer count per virtual stage, in pipeline "
            "order (virtual stage k runs on device k % pipe as its chunk k // pipe)."
        )
    if depth is not None and sum(values) != depth:
        raise PlanError(
            f"{where}: the counts sum to {sum(values)}, but the stack has {depth} layers. Give counts "
            f"that sum to {depth}."
        )
    return values


def current_plan() -> Plan | None:
    """The plan entered with `with plan:` (or by an eqxpar step while tracing)."""
    return _CURRENT.get()
