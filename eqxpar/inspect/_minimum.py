"""The theoretical minimum communication of a plan: what any implementation of
its layout must move per device per step, derived from the plan, the parameter
shapes and (for tensor and pipeline parallelism) the loss function's own
computation, never from compiled code.

Counted as `eqxpar.inspect.collective_stats` counts a compiled step: result bytes
and wire bytes (bandwidth-optimal rings over each group of n devices: all-gather
`(n-1)/n` of the gathered tensor, reduce-scatter `(n-1)` shards, all-reduce
`2 (n-1)/n` of the tensor, a collective-permute its bytes).
"""

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import keystr

from .._context_split import check_ulysses_heads, record_keys
from .._errors import EqxparError, PlanError
from .._mesh import CONTEXT_AXIS, EXPERT_AXIS
from .._parallel_dims import ParallelDims
from .._plan import Plan
from .._rules import mesh_axis_names
from .._sizes import itemsize
from .._specs import is_array_like
from .._text import short
from .._train._resolved_plan import ResolvedPlan
from .._train._step_layout import StepLayout
from .._train._trainable import trainable_mask
from ._jaxpr_walk import (
    TensorSum,
    aval_bytes,
    compute_outline,
    tensor_split_dims,
    tensor_sums,
    trace_jaxpr,
    with_key,
)
from ._model_layers import attention_layers, moe_layers
from ._plan_facts import PlanFacts
from ._tally import (
    CONTEXT_ALL_TO_ALL,
    CONTEXT_KEYS_VALUES,
    FSDP,
    GRADIENT_REDUCTION,
    MOE_DISPATCH,
    PIPELINE_BOUNDARIES,
    TENSOR_SUMS,
    Item,
    sum_items,
)

#: The mesh axis pipeline plans split a stack's layers over.
PIPE = "pipe"


@dataclasses.dataclass(frozen=True)
class Cost:
    """One part of a `Minimum`, as data: collectives of one `kind` over the mesh
    axes `axes`, needed for `source`, moving `bytes` result bytes and `wire_bytes`
    wire bytes per device per step; `label` is how a report prints it.

    `source` is one of `"gradient reduction"`, `"fsdp"`, `"tensor sums"`,
    `"pipeline boundaries"`, `"moe dispatch"`, `"context keys and values"`,
    `"context all-to-all"`.

    ```python
    least = eqxpar.inspect.minimum_comm(plan, model, loss=loss_fn, batch=batch)
    sum(c.wire_bytes for c in least.costs if c.source == "tensor sums")
    ```
    """

    label: str
    kind: str
    axes: tuple[str, ...]
    source: str
    bytes: int
    wire_bytes: int


@dataclasses.dataclass(frozen=True)
class Minimum:
    """Collective bytes per device per step that a plan cannot do without.

    Counted as `eqxpar.inspect.collective_stats` counts them: `bytes` (result
    bytes) and `wire_bytes` (what one device sends with bandwidth-optimal rings),
    by collective kind. `costs` says what was counted, as data (`Cost`: label,
    kind, mesh axes, source, bytes), for programs to read; `parts` is the same by
    label: description -> `(result bytes, wire bytes)`. `by_kind=False` when
    only totals are known (a number the user gave); `note` says what was counted.

    ```python
    m = eqxpar.inspect.Minimum.total(1_000_000, wire_bytes=1_750_000, note="my count")
    m.total_bytes   # 1_000_000
    ```
    """

    bytes: dict[str, int]
    wire_bytes: dict[str, int] | None
    note: str
    by_kind: bool = True
    costs: tuple[Cost, ...] = ()

    @classmethod
    def total(cls, result_bytes: int, *, wire_bytes: int | None = None, note: str = "given") -> "Minimum":
        """A minimum known only as totals (result bytes, optionally wire bytes)."""
        wire = None if wire_bytes is None else {"total": int(wire_bytes)}
        return cls(bytes={"total": int(result_bytes)}, wire_bytes=wire, note=note, by_kind=False)

    @property
    def parts(self) -> dict[str, tuple[int, int]]:
        """The costs by their printed label: label -> `(result bytes, wire bytes)`."""
        return {c.label: (c.bytes, c.wire_bytes) for c in self.costs}

    @property
    def total_bytes(self) -> int:
        """Result bytes of all kinds."""
        return sum(self.bytes.values())

    @property
    def total_wire_bytes(self) -> int | None:
        """Wire bytes of all kinds, or None when unknown."""
        return None if self.wire_bytes is None else sum(self.wire_bytes.values())


# --- Tallying collectives --------------------------------------------------------------


def _minimum(items: list[Item], note: str) -> Minimum:
    """A `Minimum` of tallied collectives (kinds and parts that move nothing left out)."""
    result: dict[str, int] = defaultdict(int)
    wire: dict[str, int] = defaultdict(int)
    parts: dict[str, list[int]] = {}
    first: dict[str, Item] = {}  # the kind, axes and source of each part (its items share them)
    for item in items:
        if not item.result:
            continue
        result[item.kind] += item.result
        wire[item.kind] += item.wire
        part = parts.setdefault(item.part, [0, 0])
        first.setdefault(item.part, item)
        part[0] += item.result
        part[1] += item.wire
    costs = tuple(
        Cost(label, first[label].kind, first[label].axes, first[label].source, a, b)
        for label, (a, b) in parts.items()
    )
    return Minimum(bytes=dict(result), wire_bytes=dict(wire), note=note, costs=costs)


def _axes_text(axes: list[str], sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}={sizes[a]}" for a in axes)


# --- Parameter traffic: gradient reduction, FSDP gathers --------------------------------


def _is_inexact(x: Any) -> bool:
    # Floating-point arrays and their eval_shape outlines: the leaves with gradients.
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _in_stack(params: Any) -> list[bool]:
    """Per leaf of `params` (in `jax.tree.leaves` order): whether it lies in an
    `eqxpar.nn.Stacked`, whose scan re-gathers FSDP weights under `Plan(remat=...)`."""
    from ..nn._stack import Stacked

    def mark(node: Any) -> Any:
        return jax.tree.map(lambda _: isinstance(node, Stacked), node)

    marked = jax.tree.map(mark, params, is_leaf=lambda n: isinstance(n, Stacked))
    return jax.tree.leaves(marked)


def _gathers(remat: Any, in_stack: bool, gathers: int | None) -> int:
    # How often a weight split over batch axes is all-gathered per step: once when
    # the gathered weight is kept for the backward pass; a scanned stack under
    # remat "dots"/"inputs" gathers again for the backward, "full" once more for
    # the recomputed forward.
    if gathers is not None:
        return gathers
    if not in_stack or remat == "none":
        return 1
    return 3 if remat == "full" else 2


def _gathers_at_use(remat: Any, in_stack: bool, gathers: int | None) -> int:
    # Per micro-batch, under a pipeline's `stage_gradients="sharded"`: a stack's
    # weights as a stack's (the stage forward, and the backward's re-gathers; a
    # policy other than "none", which the plan refuses there); a weight outside
    # the stack once in its stage's forward and once more in the backward,
    # which does not keep it whole.
    if gathers is not None:
        return gathers
    return _gathers(remat, True, None) if in_stack else 2


def _first(dtype: Any, default: Any) -> Any:
    # A plan's optional dtype, else the leaf's own.
    return default if dtype is None else dtype


def _param_items(
    facts: PlanFacts, params: Any, updates: Any, *, gathers: int | None, moved: Any, trains: Any = None
) -> list[Item]:
    """The gradient reductions and FSDP gathers of every floating-point leaf.

    Per leaf, with `L` its bytes on one device of the non-batch axes (tensor,
    pipe) and `g` the batch-axis devices its spec (under ZeRO-1: its optimizer
    state's spec) splits it over: `g > 1` all-gathers `L` (in the compute dtype)
    `_gathers` times over `g`, reduce-scatters its gradient and all-reduces the
    shard over the remaining replicas; `g == 1` all-reduces `L` (in `reduce_dtype`,
    else its own dtype) over its replicas: the batch axes, and `pipe` for a leaf
    outside the pipelined stack (every stage holds a copy). Leaves of one group
    are summed into one collective, as XLA combines them. A frozen leaf (False in
    `trains`, a bool per leaf) has no gradient to reduce: only its FSDP gathers count.
    `updates` are the step layout's update specs (`StepLayout.updates`).
    """
    dims = facts.dims
    sizes = {str(k): int(v) for k, v in facts.mesh.shape.items()}
    # The context axis' devices each hold a share of the loss too (its sequence part).
    batch = [a for a in (*dims.batch_axes, CONTEXT_AXIS) if sizes.get(a, 1) > 1]
    allowed = set(dims.batch_axes) | {dims.tensor_axis} | ({PIPE} if dims.schedule is not None else set())
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    # Under ZeRO-1 the optimizer state's layout says which weights are split and gathered.
    specs = jax.tree.structure(params).flatten_up_to(updates)
    groups: dict[tuple[str, str, int, int], int] = defaultdict(int)
    why: dict[str, tuple[str, tuple[str, ...]]] = {}  # part -> (source, axes)
    trained = [True] * len(flat) if trains is None else jax.tree.structure(params).flatten_up_to(trains)
    at_use = dims.schedule is not None and dims.stage_gradients == "sharded"
    for (path, leaf), spec, stacked, trains_leaf in zip(flat, specs, _in_stack(params), trained, strict=True):
        if not _is_inexact(leaf):
            continue
        axes = [a for entry in spec for a in mesh_axis_names(entry) if sizes[a] > 1]
        for axis in axes:
            if axis not in allowed:
                raise PlanError(
                    f"minimum_comm: parameter {keystr(path)} has spec {spec}, split over mesh axis "
                    f"{axis!r}, which is neither a batch axis {dims.batch_axes}, the tensor axis "
                    f"{dims.tensor_axis!r} nor (pipeline plans) 'pipe'; eqxpar knows no minimum for "
                    "that layout. Pass your own count as comm_report(..., minimum=Minimum.total(...))."
                )
        size = itemsize(leaf.dtype)
        # Experts split over `expert` stay split (never gathered), and their
        # gradients are whole there: like a tensor split, not like FSDP. Beside
        # other batch axes (rules.EXPERT_FSDP) `expert` is an FSDP split.
        kept = [EXPERT_AXIS] if any(mesh_axis_names(e) == (EXPERT_AXIS,) for e in spec) else []
        local = (
            math.prod(leaf.shape) * size // math.prod(sizes[a] for a in axes if a not in batch or a in kept)
        )
        split = [a for a in axes if a in batch and a not in kept]
        rest = [a for a in batch if a not in split and a not in kept]
        if dims.schedule is not None and PIPE not in axes and sizes.get(PIPE, 1) > 1:
            rest.append(PIPE)
        g, r = math.prod(sizes[a] for a in split), math.prod(sizes[a] for a in rest)
        reduced = f"gradient all-reduce over {_axes_text(rest, sizes)}"
        if g > 1:
            dtype = moved if moved is not None else _first(dims.compute_dtype, leaf.dtype)
            whole = local * itemsize(dtype) // size
            k, scatters = _gathers(dims.remat, stacked, gathers), 1
            if at_use:
                # Plan(stage_gradients="sharded"): gathered at each use, each
                # micro-batch's gradient reduce-scattered.
                k, scatters = (
                    _gathers_at_use(dims.remat, stacked, gathers) * dims.microbatches,
                    dims.microbatches,
                )
            over = _axes_text(split, sizes)
            gather, scatter = (
                f"FSDP all-gather over {over} ({k} per step)",
                f"FSDP gradient reduce-scatter over {over}" + (f" ({scatters} per step)" if at_use else ""),
            )
            groups[(gather, "all-gather", g, k)] += whole
            why[gather] = (FSDP, tuple(split))
            if not trains_leaf:
                continue
            groups[(scatter, "reduce-scatter", g, scatters)] += whole // g
            groups[(reduced, "all-reduce", r, 1)] += whole // g
            why[scatter] = (FSDP, tuple(split))
        elif not trains_leaf:
            continue
        else:
            dtype = _first(dims.reduce_dtype, leaf.dtype)
            groups[(reduced, "all-reduce", r, 1)] += local * itemsize(dtype) // size
        why[reduced] = (GRADIENT_REDUCTION, tuple(rest))
    return [
        Item(part, kind, n, size, repeat, source=why[part][0], axes=why[part][1])
        for (part, kind, n, repeat), size in groups.items()
    ]


# --- Plans: the parts put together ------------------------------------------------------


def _need(loss: Any, batch: Any, why: str) -> None:
    if loss is None or batch is None:
        raise PlanError(
            f"minimum_comm(plan, model): this plan {why}, whose traffic depends on the model's "
            "computation. Pass loss= (the function the step differentiates) and batch= (the global "
            "batch, arrays or jax.ShapeDtypeStructs); comm_report(step, state, batch) passes both."
        )


def _tensor_items(facts: PlanFacts, params: Any, loss: Any, batch: Any, moved: Any) -> list[Item]:
    """The activation sums of a non-pipeline plan whose weights are split over the
    tensor axis: the whole batch's sums, each split over the batch devices."""
    dims = facts.dims
    split = tensor_split_dims(facts, params)
    if not split:
        return []
    _need(loss, batch, f"splits weights over the tensor axis {dims.tensor_axis!r}")
    args = (compute_outline(dims.compute_dtype, params), compute_outline(dims.compute_dtype, batch))
    sums = tensor_sums(with_key(loss), args, split, "loss(model, batch)", moved)
    _check_found(sums, dims.tensor_axis)
    t = dims.tensor_size
    per_device = dims.batch_size_multiple * dims.context_size
    items = sum_items(sums, t, per_device=per_device, axis=dims.tensor_axis, remat=dims.remat)
    if dims.split_saved_inputs:
        items += _saved_input_gathers(sums, t, per_device=per_device, axis=dims.tensor_axis)
    return items


def _saved_input_gathers(sums: list[TensorSum], t: int, *, per_device: int, axis: str) -> list[Item]:
    """Where the stack keeps the layer inputs it saves split over the tensor axis
    along their features (`ParallelDims.split_saved_inputs`): each layer's backward
    all-gathers its input whole again before it recomputes the layer, one
    all-gather per layer of what its last forward sum outputs (the layer's
    output, the next layer's input). The layout's price for holding `1/t` of the
    inputs; no sum replaces it (the forward's sums land split and are gathered
    for the next layer, an all-reduce's bytes)."""
    return [
        Item(
            "split saved layer inputs gathered for the backward",
            "all-gather",
            t,
            s.nbytes // per_device,
            s.count,
            source=TENSOR_SUMS,
            axes=(axis,),
        )
        for s in sums
        if s.where == "forward" and s.scanned and s.last
    ]


def _check_found(sums: list[TensorSum], tensor_axis: str) -> None:
    if not sums:
        raise PlanError(
            f"minimum_comm: weights are split over the tensor axis {tensor_axis!r}, but no matmul "
            "or lookup of the loss uses a split dimension (eqxpar follows eqxpar.nn layers and plain "
            "jnp matmuls of the weights), so their activation traffic is unknown. Pass your own count "
            "as comm_report(..., minimum=Minimum.total(...))."
        )


def boundary_sends(p: int, v: int, m: int, placement: str = "interleaved") -> list[int]:
    """Activations and cotangents each device sends in a step: virtual stage `k`
    sends each micro-batch's activation on unless it is the last virtual stage,
    and its cotangent back unless it is the first, unless the stage it hands
    them to runs on the same device (a V's turn: stages `p - 1` and `p`; one
    device), where nothing crosses a wire. Shared with `eqxpar._advise`."""
    from ..pipeline._placement import device_of  # imported here: see `_pipeline_items`

    sends = [0] * p
    for k in range(p * v):
        d = device_of(k, p, placement)
        for other in (k - 1, k + 1):
            if 0 <= other < p * v and device_of(other, p, placement) != d:
                sends[d] += m
    return sends


def pipeline_placement(dims: ParallelDims) -> str:
    """The placement (`eqxpar.pipeline.PLACEMENTS`) of a pipeline plan's virtual
    stages (`dims`, its `ParallelDims`): `"v"` for the V schedules, else `"interleaved"`."""
    return "v" if dims.placement == "v" else "interleaved"


def _pipeline_items(facts: PlanFacts, params: Any, loss: Any, batch: Any, moved: Any) -> list[Item]:
    """The busiest pipeline device's activation traffic: stage-boundary
    collective-permutes and, with the tensor axis, its stage's activation sums
    (and the embedding's on the first stage, the head's on the last)."""
    dims = facts.dims
    # Imported here, as `boundary_sends` imports the placement: eqxpar.pipeline stays
    # out of importing eqxpar.inspect.
    from ..pipeline._loss import PipelineLoss
    from ..pipeline._placement import device_of

    _need(loss, batch, f"pipelines a stack (schedule={dims.schedule!r})")
    if not isinstance(loss, PipelineLoss):
        raise PlanError(
            f"minimum_comm(plan, model, loss={short(loss)}): a pipeline plan needs the "
            "eqxpar.pipeline.PipelineLoss the step runs, to find the stack and its input."
        )
    from ..nn import in_natural_order

    p, v, m = facts.mesh.shape[PIPE], dims.chunks, dims.microbatches
    # One micro-batch on one device of the batch axes, its part of the sequence.
    share = dims.batch_size_multiple * m * dims.context_size
    # The stack traced in natural order: the traffic does not depend on the order
    # it is stored in, and a stored order runs the layers through a gather of its
    # rows, which hides the weights' split from the walk (interleaved, uneven and
    # V stacks are stored so).
    params = in_natural_order(params)
    model, data = compute_outline(dims.compute_dtype, params), compute_outline(dims.compute_dtype, batch)
    _, h, _ = trace_jaxpr(loss.first, (model, data), "loss.first(model, batch)")
    boundary = sum(aval_bytes(x, moved) for x in jax.tree.leaves(h)) // share
    split = tensor_split_dims(facts, params)
    t = dims.tensor_size
    first = last = stack = []
    if split:
        run_stack = lambda mod, x: loss.stack_of(mod)(x)  # noqa: E731
        stack = tensor_sums(run_stack, (model, h), split, "the stack", moved)
        first = tensor_sums(loss.first, (model, data), split, "loss.first", moved)
        last = tensor_sums(loss.last, (model, h, data), split, "loss.last", moved)
        _check_found(stack + first + last, dims.tensor_axis)
    busiest: list[Item] = []
    placement = pipeline_placement(dims)
    # The device of the last virtual stage: p - 1, or 0 in a V (the first's too).
    head = device_of(p * v - 1, p, placement)
    for d, sends in enumerate(boundary_sends(p, v, m, placement)):
        items = [
            Item(
                "pipeline stage boundaries",
                "collective-permute",
                p,
                boundary,
                sends,
                source=PIPELINE_BOUNDARIES,
                axes=(PIPE,),
            )
        ]
        # The stack's layers are shared out over the stages; every micro-batch runs through them.
        tensor = dims.tensor_axis
        items += sum_items(stack, t, per_device=share, axis=tensor, repeat=(m, p), remat=dims.remat)
        items += sum_items(first if d == 0 else [], t, per_device=share, axis=tensor, repeat=(m, 1))
        items += sum_items(last if d == head else [], t, per_device=share, axis=tensor, repeat=(m, 1))
        if not busiest or sum(i.wire for i in items) > sum(i.wire for i in busiest):
            busiest = items
    return busiest


def _note(facts: PlanFacts, items: list[Item]) -> str:
    dims = facts.dims
    sizes = {str(k): int(v) for k, v in facts.mesh.shape.items()}
    batch = [a for a in dims.batch_axes if sizes[a] > 1]
    kinds = {i.kind for i in items if i.result}
    what = []
    if "all-gather" in kinds:
        what.append("FSDP: weights all-gathered, gradients reduce-scattered")
    if any(i.part.startswith("tensor") and i.result for i in items):
        what.append(f"tensor parallel over {dims.tensor_axis}={sizes[dims.tensor_axis]}: activation sums")
    if dims.schedule is not None:
        what.append(f"pipeline over pipe={sizes.get(PIPE, 1)}: the busiest stage's boundaries")
    if dims.context_size > 1:
        moved = "q, k, v and outputs" if dims.context_attention == "ulysses" else "keys and values"
        what.append(f"context parallel over {CONTEXT_AXIS}={dims.context_size}: attention {moved}")
    if dims.expert_size > 1:
        what.append(f"expert parallel over {EXPERT_AXIS}={dims.expert_size}: routed activations")
    devices = _axes_text(batch, sizes) or "1 device"
    if not what:
        return f"minimum: data parallel over {devices}, one gradient all-reduce"
    return f"minimum: {'; '.join(what)}; batch over {devices}"


def _checked(params: Any, gathers: Any, moved_dtype: Any) -> Any:
    """`moved_dtype` as a dtype (or None), after checking `minimum_comm`'s other arguments."""
    if not any(_is_inexact(x) for x in jax.tree.leaves(params)):
        raise EqxparError(
            f"minimum_comm(plan, params={type(params).__name__}): params has no floating-point "
            "arrays, so nothing gets a gradient. Pass the model (or its eqx.filter_eval_shape outline)."
        )
    if gathers is not None and (not isinstance(gathers, int) or isinstance(gathers, bool) or gathers < 1):
        raise PlanError(f"minimum_comm(gathers={short(gathers)}): expected a positive int, or None.")
    try:
        return None if moved_dtype is None else jnp.dtype(moved_dtype)
    except TypeError as e:
        raise PlanError(
            f"minimum_comm(moved_dtype={short(moved_dtype)}): not a dtype; use e.g. jnp.float32."
        ) from e


def minimum_comm(
    plan: Any,
    params: Any,
    *,
    loss: Callable | None = None,
    batch: Any = None,
    gathers: int | None = None,
    moved_dtype: Any = None,
    trainable: Any = None,
) -> Minimum:
    """The collective traffic a step under `plan` cannot do without, per device.

    Derived from the plan, the parameter shapes and, where activations move, the
    loss's computation on one device (its jaxpr on shape outlines; no compiled
    code). Ring wire bytes over n devices: all-reduce `2 (n-1)/n` of the tensor,
    all-gather `(n-1)/n`, reduce-scatter `n-1` shards, collective-permute 1x.

    - **Gradients**: a parameter replicated over `r` data-parallel devices (the
      batch axes; `pipe` too for a pipeline's non-stack leaves) is all-reduced
      once, one combined collective per group.
    - **FSDP, HSDP, ZeRO-1** (a parameter, or its ZeRO-1 optimizer state, split over
      `g` batch devices): one all-gather of the weight (compute dtype) when the
      gathered copy is kept for the backward pass, the least that layout allows:
      `remat="none"`, and every weight outside an `eqxpar.nn.Stacked`. A stack
      under `remat="dots"|"inputs"` gathers again for the backward (2 per step),
      under `"full"` once more for the recomputed forward (3). Then one
      reduce-scatter of its gradient, and (HSDP) an all-reduce of the shard over
      the other batch devices. A pipeline under `Plan(stage_gradients="sharded")`
      gathers at each use instead: per micro-batch, a stack's weights as above
      (2 or 3) and a weight outside the stack twice (its stage's forward, and
      its backward; a last stage whose forward the schedule runs inside its
      backward gathers once there, so this counts one gather more than it
      needs), and one reduce-scatter of each micro-batch's gradient.
    - **Tensor parallelism** (`t` devices of `plan.tensor_axis`): one activation
      all-reduce per row-parallel matmul output (forward), per column-parallel
      matmul input (backward; once for Q, K, V sharing it) and per lookup in
      vocabulary-split rows (forward): 4 per transformer layer, on this device's
      rows. A stack's recomputed forward sums again: under `remat="inputs"` all
      but each layer's last sum (5 per layer), under `"full"` every one once
      more (7 per layer); `"dots"` keeps the summed outputs. Sequence parallelism and ring overlap move the same wire bytes.
      Where the stack keeps the layer inputs it saves split over the tensor axis
      (remat `"inputs"` or `"full"` in automatic mode, `ParallelDims.split_saved_inputs`),
      each layer's backward all-gathers its input again: one all-gather per layer.
    - **Context parallelism** (`n` devices of the `context` axis): the gradient
      all-reduce also runs over `context`; every attention layer's keys and
      values reach the other `n-1` devices (an all-gather's wire bytes, compute
      dtype) and their gradients come back (a reduce-scatter's); activations
      and tensor sums are `1/n` per device. Under
      `context_attention="ulysses"` instead: every attention layer's q, k, v go
      from sequence-split to head-split by all-to-all and its output comes
      back by another, forward, and the four transposes run backward, each
      sending `(n-1)/n` of this device's part (key/value heads repeated to
      `lcm(kv_heads, n)` when fewer than `n` share a device).
    - **Expert parallelism** (`n` devices of the `expert` axis): experts split
      over it are neither gathered nor reduced over it; every `eqxpar.nn.MoE`
      layer sends this device's routed activations (`tokens * top_k` rows of
      `d_model`, compute dtype) to their experts' devices and the outputs back,
      forward, and both transposed backward: four all-to-alls of those rows,
      `(n-1)/n` of each leaving the device; a stack's recompute runs the forward
      pair again (six under `remat="inputs"`, eight under `"full"`). (A dropless step with static
      shapes moves `n` times as much, see `eqxpar.nn.MoE`; with a capacity
      factor `c`, about `c` times.)
    - **Pipelines** (`p` stages, `v` chunks, `m` micro-batches): the busiest
      device's boundary collective-permutes, `m (2v - 1)` (end stages) or `2 m v`
      micro-batch activations (in a V placement, `zb_v` and `dualpipe_v`, the
      end devices `2m`: the V's turn on device `p - 1` hands its activation and
      cotangent over on the device, and device 0 holds both end stages), plus
      its stage's tensor sums (`1/p` of the layers, every micro-batch) and the
      embedding's or head's on the devices of the end stages.

    Not counted: scalar reductions (loss, gradient-norm partial sums), a
    vocabulary-parallel cross-entropy's per-token statistics, and under sequence
    parallelism the sum over `t` of replicated weights' gradients.

    **Arguments:**

    - `plan`: the `eqxpar.Plan`.
    - `params`: the model (or its `eqx.filter_eval_shape` outline).
    - `loss`, `batch`: the function the step differentiates, `loss(model, batch)`
      (an `eqxpar.pipeline.PipelineLoss` for a pipeline), and a global batch
      (arrays or `jax.ShapeDtypeStruct`s); needed for tensor and pipeline plans.
    - `gathers`: all-gathers per step of an FSDP-split weight, instead of the count
      `remat` gives.
    - `moved_dtype`: count compute-dtype traffic in this dtype (XLA:CPU moves
      bfloat16 collectives as float32).
    - `trainable`: the step's filter of the weights that train (as
      `make_step(..., trainable=)` takes it); frozen ones reduce no gradient, and
      only their FSDP gathers count. Default None: every floating-point weight trains.

    **Returns:** a `Minimum` by kind, its `parts` named.

    **Raises:** `PlanError` for what it cannot describe: a weight split over an axis
    that is neither a batch axis, the tensor axis nor `pipe`; a tensor or pipeline
    plan without `loss` and `batch`, or whose loss uses no split weight dimension in
    a matmul or lookup. `EqxparError` when `params` has no floating-point array.

    ```python
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    eqxpar.inspect.minimum_comm(plan, model).bytes["all-reduce"]   # the gradient bytes
    tp = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON)
    eqxpar.inspect.minimum_comm(tp, model, loss=loss_fn, batch=(x, y)).parts
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"minimum_comm(plan={short(plan)}, ...): expected an eqxpar.Plan.")
    moved = _checked(params, gathers, moved_dtype)
    # The plan resolved here, once: the helpers below take these, never the plan.
    facts = PlanFacts.of(plan)
    trains = trainable_mask(params, trainable, plan, where="minimum_comm")
    updates = StepLayout.of(ResolvedPlan.of(plan), params).updates
    items = _param_items(facts, params, updates, gathers=gathers, moved=moved, trains=trains)
    if facts.dims.schedule is not None:
        items += _pipeline_items(facts, params, loss, batch, moved)
    else:
        items += _tensor_items(facts, params, loss, batch, moved)
    items += _context_items(facts, params, loss, batch, moved)
    items += _expert_items(facts, params, loss, batch, moved)
    return _minimum(items, _note(facts, items))


def _expert_items(facts: PlanFacts, params: Any, loss: Any, batch: Any, moved: Any) -> list[Item]:
    """Expert parallelism over `n` devices: every MoE layer sends this device's
    routed activations (`tokens * top_k` rows of `d_model`, compute dtype) to the
    devices of their experts and the outputs back (two all-to-alls, `(n-1)/n`
    of them leaving the device), and the backward pass runs both transposed; a
    stack's layers run their forward pair again where the plan's remat
    recomputes it; in a pipeline, the busiest stage's `1/p` of the layers."""
    dims = facts.dims
    from ..nn._moe import record_dispatches

    n = dims.expert_size
    if n == 1:
        return []
    moes = moe_layers(params)
    if not moes:
        return []
    _need(loss, batch, f"splits the experts over {EXPERT_AXIS!r} ({EXPERT_AXIS}={n})")
    with record_dispatches() as seen:
        trace_jaxpr(
            with_key(loss),
            (compute_outline(dims.compute_dtype, params), compute_outline(dims.compute_dtype, batch)),
            "loss(model, batch)",
        )
    if not seen:
        return []
    # One layer per MoE module, times its stack depth (a stacked layer's expert
    # weights have a leading depth dimension). A stack's recomputed forward runs
    # its two all-to-alls again: once under remat "inputs", twice under "full"
    # (counted on compiled steps: XLA:CPU and the TPU compiler alike).
    runs = {"inputs": 2, "full": 3}.get(dims.remat, 1)
    p = facts.mesh.shape.get(PIPE, 1)
    stacked = sum(m.w_in.shape[0] for m in moes if m.w_in.ndim == 4) // p
    single = sum(1 for m in moes if m.w_in.ndim != 4) // p
    count = (2 * runs + 2) * stacked + 4 * single
    routed = seen[0]
    per_device = dims.batch_size_multiple * dims.context_size
    rows = routed.shape[0] // per_device
    size = rows * routed.shape[1] * itemsize(_first(moved, routed.dtype))
    part = f"MoE dispatch and combine over {EXPERT_AXIS}={n}"
    return [
        Item(
            f"{part}: forward and backward all-to-alls",
            "all-to-all",
            n,
            size,
            count,
            source=MOE_DISPATCH,
            axes=(EXPERT_AXIS,),
        )
    ]


def _context_items(facts: PlanFacts, params: Any, loss: Any, batch: Any, moved: Any) -> list[Item]:
    """Context parallelism over `n` devices: every attention layer's keys and values
    reach every device of the context axis ((n-1)/n of them, an all-gather's wire
    bytes, in the compute dtype) and their gradients go back (a reduce-scatter);
    in a pipeline, the busiest stage's `1/p` of the layers."""
    dims = facts.dims
    n = dims.context_size
    if n == 1:
        return []
    _need(loss, batch, f"splits the sequence over {CONTEXT_AXIS!r} ({CONTEXT_AXIS}={n})")
    with record_keys() as keys:
        trace_jaxpr(
            with_key(loss),
            (compute_outline(dims.compute_dtype, params), compute_outline(dims.compute_dtype, batch)),
            "loss(model, batch)",
        )
    # One layer per attention module, times its stack depth (a stacked layer's output
    # weight has a leading depth dimension).
    layers = sum(a.wo.shape[0] if a.wo.ndim == 4 else 1 for a in attention_layers(params))
    layers //= facts.mesh.shape.get(PIPE, 1)
    if not keys or not layers:
        return []
    k = keys[0]
    t = dims.tensor_size
    kv_split = t if _heads_split(facts, params, "wk") else 1
    if dims.context_attention == "ulysses":
        q_split = t if _heads_split(facts, params, "wq") else 1
        return _ulysses_items(dims, params, k, (q_split, kv_split), layers, moved)
    whole = 2 * aval_bytes(k, _first(moved, dims.compute_dtype)) // dims.batch_size_multiple // kv_split
    part = f"attention keys and values over {CONTEXT_AXIS}={n}"
    kv = {"source": CONTEXT_KEYS_VALUES, "axes": (CONTEXT_AXIS,)}
    items = [
        Item(f"{part}: all-gather", "all-gather", n, whole, layers, **kv),
        Item(f"{part}: gradient reduce-scatter", "reduce-scatter", n, whole // n, layers, **kv),
    ]
    if dims.context_attention_run == "ring":
        # A ring holds one block of keys and values at a time, never all `n`: its
        # backward pass needs every block again, so they pass around the ring once
        # more ((n-1)/n of them, as the forward's gather). Passing the queries, output
        # cotangents and query gradients instead would move more: three tensors of
        # query heads against one of key/value heads.
        items.append(
            Item(
                f"{part}: passed again in the backward (ring)",
                "collective-permute",
                n,
                whole * (n - 1) // n,
                layers,
                **kv,
            )
        )
    return items


def _ulysses_items(
    dims: ParallelDims, params: Any, k: Any, splits: tuple[int, int], layers: int, moved: Any
) -> list[Item]:
    """Ulysses over `n` devices: per attention layer, this device's sequence part of
    q, k, v (key/value heads repeated to `lcm(kv heads, n)` when fewer) goes to
    head-split by all-to-all and the output comes back by another, forward; the
    backward pass runs the four transposed. An all-to-all sends `(n-1)/n` of it."""
    n = dims.context_size
    q_split, kv_split = splits
    heads = {a.num_heads for a in attention_layers(params)}
    for h in heads:
        check_ulysses_heads(h, q_split, n, "minimum_comm")
    b, s, kv_heads, d = k.shape
    hkv = kv_heads // kv_split
    hkv = math.lcm(hkv, n)
    element = itemsize(_first(_first(moved, dims.compute_dtype), k.dtype))
    tokens = b * s // (dims.batch_size_multiple * n)
    # One layer's q, output, k and v (as moved) on this device; every layer has the
    # first layer's shapes (the keys recorded are the first attention call's).
    size = tokens * d * element * (2 * max(heads) // q_split + 2 * hkv)
    part = f"attention queries, keys, values and outputs over {CONTEXT_AXIS}={n}"
    return [
        Item(
            f"{part}: all-to-all, forward and backward",
            "all-to-all",
            n,
            size,
            2 * layers,
            source=CONTEXT_ALL_TO_ALL,
            axes=(CONTEXT_AXIS,),
        )
    ]


def _heads_split(facts: PlanFacts, params: Any, weight: str) -> bool:
    # Whether the rules split the query ("wq") or key/value ("wk") heads over the
    # tensor axis (a fused QKV weight splits both).
    for attention in attention_layers(facts.specs(params)):
        spec = getattr(attention, weight) if attention.wqkv is None else attention.wqkv
        if spec is not None and any(facts.dims.tensor_axis in mesh_axis_names(e) for e in spec):
            return True
    return False
