"""Predict a plan's memory, wire bytes and step time per device, from shapes."""

import dataclasses
import math
from collections import Counter, defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .._fsdp import kept_axes
from .._mesh import AXES
from .._parallel_dims import ParallelDims
from .._plan import Plan
from .._remat import RematPolicy
from .._rules import mesh_axis_names
from .._sizes import itemsize, nbytes
from .._specs import is_array_like
from .._train._resolved_plan import ResolvedPlan
from .._train._step_layout import StepLayout
from ..inspect import Minimum, minimum_comm
from ..inspect._jaxpr_walk import (
    TensorSum,
    TensorSumWalk,
    aval_bytes,
    compute_outline,
    tensor_split_dims,
    trace_jaxpr,
    with_key,
)
from ..inspect._minimum import boundary_sends, pipeline_placement
from ..inspect._model_layers import moe_layers
from ..inspect._plan_facts import PlanFacts
from ..inspect._tally import CONTEXT_KEYS_VALUES, MOE_DISPATCH, PIPELINE_BOUNDARIES, TENSOR_SUMS, sum_items
from ..nn._moe_dispatch import ragged_on
from ..pipeline._actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
from ..pipeline._program import (
    RES_READ,
    RES_WRITE,
    STASH_READ,
    STASH_WRITE,
    build_program,
    senders,
    slot_used,
    stores_residuals,
    tick_loops,
)
from ._analysis import Analysis, Slots, engine_slots
from ._offload import offload_terms, policy_activations
from ._profile import DeviceProfile
from ._shard_bytes import per_device_bytes, split_count
from ._tpu import TpuTerms, extra_wire, pipeline_wire, spans_slices, tpu_terms

#: Fitted on the benchmark records (benchmarks/results/quick.json, XLA:CPU): the
#: optimizer update holds about this share of the updated parameters' bytes in
#: temporaries beside the gradients (AdamW's new moments are written in place).
UPDATE_SHARE = 0.6
#: The step counter and skipped-step count (int32 each) and PRNG key (two uint32)
#: a `TrainState` also passes.
STATE_SCALARS = 16


def placeholder_mesh(sizes: dict[str, int]) -> Mesh:
    """A mesh of eqxpar's axes with `sizes`, over this machine's devices when there
    are enough, else over one device repeated: a shape for prediction only (nothing
    can be placed on it), so that plans for 64 or 512 devices can be described here."""
    shape = tuple(int(sizes.get(a, 1)) for a in AXES)
    n = math.prod(shape)
    devices = jax.devices()
    chosen = devices[:n] if n <= len(devices) else [devices[0]] * n
    grid = np.empty(n, dtype=object)
    grid[:] = chosen
    return Mesh(grid.reshape(shape), AXES)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What one step of a plan needs per device, predicted without compiling.

    Bytes per device: `params_bytes`, `opt_state_bytes`, `batch_bytes` (the
    arguments, exact from the layout); `gradient_bytes`, `activation_bytes`
    (residuals saved for the backward pass; a pipeline's kept residual slots),
    `gathered_bytes` (FSDP weights gathered whole), `buffer_bytes` (a pipeline's
    input / cotangent slots and a tick's transients; a dropless MoE layer's
    grouped-matmul and dispatch buffers) and
    `update_bytes` (optimizer temporaries): the temporaries. `wire_bytes` by
    collective kind and `wire_bytes_by_axis` by mesh axes (what one device
    sends); `flops` per device; `compute_s`, `comm_s` and `step_time_s` on the
    profile (communication not overlapped: an upper bound). `host_argument_bytes`:
    the part of the state a plan offloads (`Plan(offload=...)`), in host memory
    (`host_bytes`), not among the device's `argument_bytes`.

    ```python
    p = advice.candidates[0].prediction
    p.memory_bytes, p.wire_bytes, p.step_time_s
    ```
    """

    params_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    gradient_bytes: int
    activation_bytes: int
    gathered_bytes: int
    buffer_bytes: int
    update_bytes: int
    wire_bytes: dict[str, int]
    wire_bytes_by_axis: dict[str, int]
    flops: float
    compute_s: float
    comm_s: float
    step_time_s: float
    #: Of `params_bytes + opt_state_bytes`, what the plan keeps in host memory
    #: (`Plan(offload=("params" / "optimizer",))`): arguments, but not the device's.
    host_argument_bytes: int = 0
    #: The device temporaries bringing the offloaded state onto the device adds
    #: (`_offload.offload_terms`).
    offload_bytes: int = 0
    #: The host temporaries: the activations the plan offloads (`_offload`).
    host_temp_bytes: int = 0

    @property
    def argument_bytes(self) -> int:
        """The step's arguments in device memory: state arrays and batch, less
        what the plan offloads (`memory_analysis().argument_size_in_bytes`)."""
        return (
            self.params_bytes
            + self.opt_state_bytes
            + self.batch_bytes
            + STATE_SCALARS
            - self.host_argument_bytes
        )

    @property
    def host_bytes(self) -> int:
        """Host memory the step holds per device: the offloaded state
        (`memory_analysis()`'s `host_argument_size_in_bytes`; the new state is
        written over it) and the offloaded activations (its host temporaries)."""
        return self.host_argument_bytes + self.host_temp_bytes

    @property
    def temp_bytes(self) -> int:
        """The step's temporaries (`memory_analysis().temp_size_in_bytes`)."""
        return (
            self.gradient_bytes
            + self.activation_bytes
            + self.gathered_bytes
            + self.buffer_bytes
            + self.update_bytes
            + self.offload_bytes
        )

    @property
    def memory_bytes(self) -> int:
        """Arguments + temporaries: what the step needs on each device while it runs."""
        return self.argument_bytes + self.temp_bytes

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())


def _gradient_bytes(params: Any, specs: Any, mesh: Mesh, batch_axes: frozenset[str]) -> int:
    """Per device, the gradients as they come out of the loss: whole over the
    batch axes (then reduced or scattered), except over `expert` where it splits
    a dimension alone (the experts, never gathered: `kept_axes`)."""
    flat = jax.tree.structure(params).flatten_up_to(specs)
    pairs = zip(jax.tree.leaves(params), flat, strict=True)
    return sum(
        nbytes(x) // split_count(s, mesh, batch_axes - kept_axes(s)) for x, s in pairs if is_array_like(x)
    )


def _tensor_dims(params: Any, specs: Any, tensor: str) -> set[int]:
    # Sizes of the weight dimensions split over the tensor axis (heads, MLP features).
    sizes = set()
    flat = jax.tree.structure(params).flatten_up_to(specs)
    for x, spec in zip(jax.tree.leaves(params), flat, strict=True):
        if isinstance(spec, PartitionSpec) and is_array_like(x):
            sizes |= {x.shape[i] for i, e in enumerate(spec) if tensor in mesh_axis_names(e)}
    return sizes


def _activations(
    facts: PlanFacts, analysis: Analysis, params: Any, specs: Any, manual: frozenset[str]
) -> int:
    """Residual bytes per device: each residual split as the batch and sequence
    are, and over the tensor axis where it has a dimension the rules split there
    (or every one, under sequence parallelism). MoE residuals have the batch's
    tokens flattened: those of the routed rows (`tokens * top_k`) split as the
    batch, then, under dropless expert parallelism over `n` devices, `n` times
    that (a device's experts take up to every device's rows: static buffers of
    `n` devices' assignments), split over the tensor axis only where the experts
    are, less the experts' hidden activations there (recomputed a block at a
    time); those of the tokens (the router's) split as the batch. `specs`: the
    parameters' (`StepLayout.params`); `manual`: the step's manual axes."""
    dims = facts.dims
    t = dims.tensor_size
    split_dims = _tensor_dims(params, specs, dims.tensor_axis) if t > 1 else set()
    b, c = analysis.batch_size, dims.context_size
    routed = analysis.routed.shape[0] if analysis.routed is not None else None
    tokens = b * analysis.seq_len if analysis.seq_len is not None else None
    moe = _moe_split(facts, params, specs, manual)
    # Dropless expert parallelism runs the experts over the receive buffer one
    # source's block at a time, rematerialised (`MoE._grouped_by_source`).
    blocks = moe["dropless"] and dims.expert_size > 1
    total = 0
    for r in analysis.residuals:
        shape = r.shape
        if b not in shape[:-1] and routed is not None and routed in shape[:-1]:
            after = shape[shape.index(routed) + 1 :]
            if blocks and after and after[-1] != analysis.routed.shape[1]:
                # The experts' hidden activations: recomputed a block at a time
                # (`_moe_buffers` counts one block's), never kept.
                continue
            divisor = dims.batch_size_multiple * c
            if moe["tensor"] and split_dims & set(after):
                divisor *= t
            total += nbytes(r) * moe["rows"] // divisor
            continue
        if b not in shape[:-1] and tokens is not None and tokens in shape[:-1]:
            after = shape[shape.index(tokens) + 1 :]
            divisor = dims.batch_size_multiple * c
            if t > 1 and (dims.sequence_parallel or split_dims & set(after)):
                divisor *= t
            total += nbytes(r) // divisor
            continue
        after = shape[shape.index(b) + 1 :] if b in shape[:-1] else shape
        divisor = dims.batch_size_multiple * c if b in shape[:-1] else 1
        if c > 1 and analysis.seq_len is not None and list(after).count(analysis.seq_len) >= 2:
            # Causal context attention computes a chunk's scores against the key
            # blocks at or below the diagonal only: half the dense scores.
            divisor *= 2
        if t > 1 and (dims.sequence_parallel or split_dims & set(after)):
            divisor *= t
        total += nbytes(r) // divisor
    return total


def _moe_split(facts: PlanFacts, params: Any, specs: Any, manual: frozenset[str]) -> dict:
    """How the model's MoE layers run under the plan: `rows`, the factor of the
    routed rows a device's experts take beyond its share of the batch (the expert
    axis' size when they are split over it and dropless; times the batch axes the
    compiler partitions, since a dropless layer's data-dependent shuffle of the
    tokens gathers them over those); `tensor`, whether the experts are split over
    the tensor axis."""
    dims = facts.dims
    from ..nn._moe import MoE

    is_moe = lambda x: isinstance(x, MoE)  # noqa: E731
    layers = [x for x in jax.tree.leaves(params, is_leaf=is_moe) if is_moe(x)]
    if not layers:
        return {"rows": 1, "tensor": False, "dropless": False}
    spec_layers = [x for x in jax.tree.leaves(specs, is_leaf=is_moe) if is_moe(x)]
    n = dims.expert_size
    dropless = any(layer.capacity_factor is None for layer in layers)
    tensor = any(
        isinstance(spec, PartitionSpec) and any(dims.tensor_axis in mesh_axis_names(e) for e in spec)
        for layer in spec_layers
        for spec in (layer.w_in, layer.w_out)
    )
    t = dims.tensor_size
    gathered = math.prod(facts.mesh.shape[a] for a in dims.batch_axes if a not in manual)
    return {
        "rows": n * gathered if dropless else 1,
        "tensor": tensor and t > 1,
        "dropless": dropless,
        "local": max(layer.experts for layer in layers) // n,
        "hidden": max(layer.w_in.shape[-1] for layer in layers) // (t if tensor else 1),
        "exchange": layers[0].exchange,
    }


def _moe_buffers(
    facts: PlanFacts,
    analysis: Analysis,
    params: Any,
    specs: Any,
    manual: frozenset[str],
    platform: str | None = None,
) -> int:
    """Per device, what one dropless MoE layer holds while it runs besides its
    residuals: the grouped matmuls (`ragged_dot`, which XLA:CPU computes as every
    local expert's product for all rows, then selects: local experts x rows x
    hidden, and the result, rows x hidden; under expert parallelism over `n`
    devices they run one source's block of the receive buffer at a time, a
    `n`-th of its rows), and under expert parallelism the
    static receive buffer (`n` x a device's assignments, of d_model, plus the
    int32 expert of each row; on TPU three buffers of its size in the backward)
    and the send buffer (as large, padded; the routed rows alone where the
    exchange is ragged on the device's `platform`). Rows: the
    device's routed assignments, `n` times over under expert parallelism over `n`
    devices (all of them on every
    device over the batch axes the compiler partitions: see `_moe_split`)."""
    dims = facts.dims
    moe = _moe_split(facts, params, specs, manual)
    if analysis.routed is None or not moe.get("dropless"):
        return 0
    routed, d = analysis.routed.shape
    # The experts compute in the plan's compute dtype (the analysis traces the
    # model in its parameters' dtype).
    size = itemsize(dims.compute_dtype or analysis.routed.dtype)
    rows = routed * moe["rows"] // (dims.batch_size_multiple * dims.context_size)
    grouped = rows // dims.expert_size * (moe["local"] + 1) * moe["hidden"] * size
    dispatch = 0
    if dims.expert_size > 1:
        sent = rows // dims.expert_size if ragged_on(moe["exchange"], platform) else rows
        # On TPU the backward holds the receive buffer (recomputed), the
        # cotangent of the experts' outputs over it and the buffer's own
        # cotangent at once (Mixtral 8x7B's buffer assignment, 3 x 256 MiB).
        copies = 3 if platform == "tpu" else 1
        dispatch = rows * (copies * d * size + 4) + sent * d * size
    return grouped + dispatch


def predict(
    plan: Plan,
    params: Any,
    opt_state: Any,
    batch: Any,
    loss: Any,
    analysis: Analysis,
    profile: DeviceProfile,
) -> Prediction:
    """Predict one step of `plan` per device (see `Prediction`). `params`,
    `opt_state` and `batch` are outlines; `analysis` is `analyse(model, loss, batch)`."""
    # The plan resolved here, once: the helpers below take these, never the plan.
    facts = PlanFacts.of(plan)
    dims, mesh = facts.dims, facts.mesh
    layout = StepLayout.of(ResolvedPlan.of(plan), params, opt_state)
    batch_axes = frozenset(dims.batch_axes)
    params_bytes = per_device_bytes(params, layout.params, mesh)
    opt_bytes = per_device_bytes(opt_state, layout.opt_state, mesh)
    batch_bytes = sum(nbytes(x) // dims.batch_size_multiple for x in jax.tree.leaves(batch))
    # Gradients come out whole over the batch axes but the experts' (`_gradient_bytes`).
    grads = _gradient_bytes(params, layout.params, mesh, batch_axes)
    # Manual FSDP keeps the gathered weights for the backward pass; the compiler
    # gathers them again there instead (see `_wire`).
    auto_fsdp = _auto_fsdp(dims, layout.params)
    keeps = not dims.zero1 and not auto_fsdp
    gathered = grads - params_bytes if keeps else 0
    at_use = dims.pipelined and dims.stage_gradients == "sharded"
    if at_use:  # the sums split like the weights (`_gathered_at_use`)
        grads, gathered = params_bytes, _gathered_at_use(facts, params, layout, loss, grads - params_bytes)
    # The TPU compiler partitions automatic FSDP otherwise (`_tpu`).
    on_tpu = auto_fsdp and profile.platform == "tpu"
    tpu = _tpu_terms(layout, analysis, params, params_bytes, loss, batch) if on_tpu else None
    grads = grads if tpu is None else tpu.gradients
    # Under ZeRO-1 the update runs on this device's share, but the new weights are
    # gathered whole, and XLA holds about the update's share of them in temporaries
    # (ZeRO-1 was 7.6 % under on the benchmark workload, 10.2 % on the demo's GPT).
    updated = per_device_bytes(params, layout.params if dims.zero1 else layout.updates, mesh)
    update = int(UPDATE_SHARE * updated)
    if dims.schedule is None:
        activations, buffers, update = _step_memory(
            facts, analysis, params, layout, tpu, update, profile.platform
        )
    else:
        sched = _schedule(dims, mesh.shape.get("pipe", 1))
        # One layer's backward, as under remat "none" (`_engine_layouts`).
        unremat = dataclasses.replace(plan, remat="none", stage_gradients="whole")
        engine = _engine_layouts(layout, ResolvedPlan.of(unremat), loss, params, batch)
        activations, buffers = _pipeline_memory(
            facts, sched, engine, params, batch, loss, layout, grads, split_sums=at_use
        )
        # The update runs after the tick loops, in the memory their residual
        # buffers and transients held: only what it needs beyond them adds.
        update = max(0, update - activations - buffers)
    sent = None if dims.schedule is None else _engine_sends(sched)
    moved = jnp.float32 if profile.name == "cpu" and dims.compute_dtype is not None else None
    # The compiler gathers automatic FSDP's weights again for the backward pass,
    # as a stack under remat "dots" does: counted so.
    counted = dataclasses.replace(plan, remat="dots") if auto_fsdp and dims.remat == "none" else plan
    least = minimum_comm(counted, params, loss=loss, batch=batch, moved_dtype=moved)
    wire, by_axis = _predicted_wire(
        facts, least, layout, params, loss, batch, analysis, moved, auto_fsdp, sent, profile
    )
    traffic = 3 * (params_bytes + opt_bytes) + 2 * activations
    bubble = None if dims.schedule is None else sched.bubble_fraction
    flops, compute, comm = _step_times(facts, analysis, profile, traffic, by_axis, bubble)
    return Prediction(
        params_bytes=params_bytes,
        opt_state_bytes=opt_bytes,
        batch_bytes=batch_bytes,
        gradient_bytes=grads,
        activation_bytes=activations,
        gathered_bytes=gathered,
        buffer_bytes=buffers,
        update_bytes=update,
        wire_bytes=wire,
        wire_bytes_by_axis={" x ".join(k): v for k, v in by_axis.items()},
        flops=flops,
        compute_s=compute,
        comm_s=comm,
        step_time_s=compute + comm,
        **offload_terms(layout, params, params_bytes, opt_bytes, profile.platform, loss=loss, batch=batch),
    )


def _tpu_terms(
    layout: StepLayout, analysis: Analysis, params: Any, params_bytes: int, loss: Any, batch: Any
) -> TpuTerms:
    """`tpu_terms` of the step `layout` lays out, with what a `RematPolicy` keeps
    per layer beyond the layer's input, every layer's: its saved names (the
    block's input among them is the input the stack keeps anyway) and its
    offloaded ones (`_offload` takes those off the device)."""
    dims, policy = layout.resolved.dims, layout.resolved.dims.remat
    named = 0
    if isinstance(policy, RematPolicy):
        names = (*(n for n in policy.saved if n != "decoder_layer_input"), *policy.offloaded)
        named = policy_activations(layout, params, loss, batch, names)[0]
    return tpu_terms(dims, layout.resolved.mesh, analysis, params, layout.params, params_bytes, named=named)


def _step_memory(
    facts: PlanFacts,
    analysis: Analysis,
    params: Any,
    layout: StepLayout,
    tpu: TpuTerms | None,
    update: int,
    platform: str | None = None,
) -> tuple[int, int, int]:
    """`(activations, buffers, update)` per device of a step without a pipeline
    (`update`: the optimizer's temporaries, as given; an MoE exchange ragged or
    padded as it is on the device's `platform`); on the TPU
    compiler's automatic partitioning (`tpu`), the stack's kept inputs and the
    rest of the largest phase (a dense model's, with the `update`'s temporaries
    among them) or the head's phase or one layer's backward, whichever holds more
    (an MoE model's; `_tpu`)."""
    manual = layout.manual_axes
    activations = _activations(facts, analysis, params, layout.params, manual)
    activations += _kept_inputs(facts, analysis)
    buffers = _moe_buffers(facts, analysis, params, layout.params, manual, platform)
    if tpu is not None and not moe_layers(params):
        # A dense step's phases (`_tpu`): the kept inputs, and the rest of the
        # largest phase beside them and the gradient shards (`predict` adds
        # those); the update is among the phases.
        return tpu.inputs, max(0, tpu.phases(update) - tpu.inputs - tpu.gradients), 0
    if tpu is not None:
        activations += tpu.inputs
        # The weight shards cast to compute dtype live through both phases
        # (hoisted out of the layer loops: 3 x 470 MB of expert shards on Mixtral
        # 8x7B's buffer assignment), as in a dense step.
        buffers = tpu.weights + max(tpu.head, tpu.layer + buffers)
    return activations, buffers, update


def _predicted_wire(
    facts: PlanFacts,
    least: Minimum,
    layout: StepLayout,
    params: Any,
    loss: Any,
    batch: Any,
    analysis: Analysis,
    moved: Any,
    auto_fsdp: bool,
    sent: int | None,
    profile: DeviceProfile,
) -> tuple[dict[str, int], dict[tuple[str, ...], int]]:
    """`_wire` of the plan's minimum `least` (an MoE exchange ragged or padded as
    it is on the `profile`'s platform); on the TPU compiler, under its automatic
    partitioning the gradients are reduce-scattered, and the program's
    collectives beyond the minimum are added
    (`_tpu.extra_wire`); a pipeline's with sharded stage gradients likewise
    (`_tpu.pipeline_wire`). A program over several slices (`_tpu.spans_slices`,
    with the profile's `devices_per_slice`) all-reduces what it would
    reduce-scatter, twice the bytes, and windows no einsum."""
    platform = profile.platform
    tpu = platform == "tpu"
    on_tpu = auto_fsdp and tpu
    sliced = on_tpu and spans_slices(facts.mesh, profile.devices_per_slice)
    repeats = _repeated_sums(facts, params, loss, batch, moved)
    moe = _moe_split(facts, params, layout.params, layout.manual_axes)
    ragged = "exchange" in moe and ragged_on(moe["exchange"], platform)
    wire, by_axis = _wire(
        facts,
        least,
        analysis,
        moved=moved,
        auto_fsdp=auto_fsdp,
        sent=sent,
        repeats=repeats,
        scatters=on_tpu and not sliced,
        ragged=ragged,
    )
    if tpu and facts.dims.pipelined and facts.dims.stage_gradients == "sharded":
        # A pipeline with sharded stage gradients on the TPU compiler (`_tpu`).
        for kind, by in pipeline_wire(facts.dims, facts.mesh, params, layout.params, loss).items():
            for axes, w in by.items():
                wire[kind] = wire.get(kind, 0) + w
                by_axis[axes] = by_axis.get(axes, 0) + w
    if on_tpu:
        # A minimum that counts the split saved inputs' gathers (an all-gather
        # among its tensor sums) leaves them out of the extra.
        gathers = any(c.kind == "all-gather" and c.source == TENSOR_SUMS for c in least.costs)
        extra = extra_wire(
            facts.dims,
            facts.mesh,
            analysis,
            params,
            layout.params,
            layout.manual_axes,
            inputs_counted=gathers,
            sliced=sliced,
        )
        for kind, by in extra.items():
            # Over several slices a reduce-scatter is an all-reduce and a slice (`_tpu`).
            summed = sliced and kind == "reduce-scatter"
            for axes, w in by.items():
                k, w = ("all-reduce", 2 * w) if summed else (kind, w)
                wire[k] = wire.get(k, 0) + w
                by_axis[axes] = by_axis.get(axes, 0) + w
    return wire, by_axis


def _step_times(
    facts: PlanFacts,
    analysis: Analysis,
    profile: DeviceProfile,
    traffic: int,
    by_axis: dict[tuple[str, ...], int],
    bubble: float | None,
) -> tuple[float, float, float]:
    """`(flops, compute seconds, communication seconds)` of a step per device on
    `profile`: the matmuls at its rate (a pipeline's stretched by its `bubble`
    fraction) or, when slower, the memory `traffic` at its bandwidth; the wire
    bytes `by_axis` over the slowest link each crosses."""
    mesh = facts.mesh
    flops = 3.0 * analysis.forward_flops / mesh.size
    dtype = facts.dims.compute_dtype or jnp.float32
    compute = flops / profile.flops(dtype)
    if bubble is not None:
        compute /= 1.0 - bubble
    compute = max(compute, traffic / profile.hbm_bytes_per_s)
    comm = sum(w / _rate(profile, mesh, axes) for axes, w in by_axis.items())
    return flops, compute, comm


def _schedule(dims: ParallelDims, stages: int) -> Any:
    """The plan's pipeline schedule (`eqxpar.pipeline.Schedule`) over `stages` stages."""
    from ..pipeline import Schedule
    from ..pipeline import schedule as make_schedule

    if isinstance(dims.schedule, Schedule):
        return dims.schedule
    return make_schedule(dims.schedule, stages=stages, microbatches=dims.microbatches, chunks=dims.chunks)


def _engine_sends(sched: Any) -> int:
    """Boundary buffers the busiest device sends in a step: the engine's ticks
    send from the devices that have something due only (`senders`)."""
    sent = Counter(d for forward, backward in senders(sched) for d in (*forward, *backward))
    return max(sent.values(), default=0)


def _pipeline_memory(
    facts: PlanFacts,
    sched: Any,
    engine: tuple[Slots, Slots],
    params: Any,
    batch: Any,
    loss: Any,
    layout: StepLayout,
    grads: int,
    *,
    split_sums: bool = False,
) -> tuple[int, int]:
    """`(kept residuals, buffers)` per device of a pipeline step (see
    `eqxpar.pipeline`'s engine), from the engine's own slot layout
    (`_analysis.engine_slots`: `engine` is the plan's and, for one layer's
    backward, the plan's under `remat="none"`). Kept: `schedule.buffers.residuals` slots, each
    one virtual stage's kept residuals for one micro-batch (under
    `remat="full"` none: each backward recomputes its stage).

    Buffers: the stage-input and cotangent slots, and what a tick holds beside
    the loop's carry (`_tick_transients`). `split_sums`: the gradient sums are
    split like the weights (`Plan(stage_gradients="sharded")`)."""
    dims = facts.dims
    p, v, m = facts.mesh.shape.get("pipe", 1), dims.chunks, dims.microbatches
    layers = max(1, loss.stack_of(params).depth // (p * v))
    rows = jax.tree.leaves(batch)[0].shape[0] // (dims.batch_size_multiple * m)
    slots, whole = engine
    layer = whole.stacked_bytes(layers, rows) // layers
    slot = slots.slot_bytes
    bufs = sched.buffers
    io = (max(1, bufs.inputs) + max(1, bufs.cotangents)) * nbytes(slots.activation)
    stack_grads = per_device_bytes(
        loss.stack(params).blocks,
        loss.stack(layout.params).blocks,
        facts.mesh,
        frozenset() if split_sums else frozenset(dims.batch_axes),
    )
    if dims.remat == "full":
        # Nothing is kept between ticks: a backward recomputes its stage, whose
        # scan keeps each layer's input and recomputes one layer at a time, and
        # holds one virtual stage's gradients (and the rest's) beside the sums.
        act = nbytes(slots.activation)
        return 0, io + layers * act + layer + grads - stack_grads + stack_grads // v
    stacked = slots.stacked_bytes(layers, rows)
    # Split backwards stash what `I` hands `W` in slots of their own
    # (`Buffers.stashes`), read and written by a tick as the residuals' are.
    stash = slots.stash_bytes
    backward = _backward_working_set(stacked, layers, layer, stack_grads // v)
    transients = max(_run_transients(run, slot, stash, backward) for run in _engine_runs(sched))
    return max(1, bufs.residuals) * slot + max(1, bufs.stashes) * stash, io + transients


def _engine_layouts(
    layout: StepLayout, unremat: ResolvedPlan, loss: Any, params: Any, batch: Any
) -> tuple[Slots, Slots]:
    """The engine's slot layouts under the step's plan and, for one layer's
    backward, under `unremat` (the plan with `remat="none"`): under a remat policy
    the backward recomputes what the policy dropped, so it holds about one layer's
    residuals under "none" (the engine's layout whatever the stage gradients,
    whose sharded mode refuses "none")."""
    slots = engine_slots(layout.resolved, loss, params, batch)
    if layout.resolved.dims.remat == "none":
        return slots, slots
    return slots, engine_slots(unremat, loss, params, batch)


def _gathered_at_use(facts: PlanFacts, params: Any, layout: StepLayout, loss: Any, gathered: int) -> int:
    """What a device holds whole at once under `Plan(stage_gradients="sharded")`,
    whose gradient sums are split like the weights: one layer's weights and that layer's gradient before its reduce-scatter, and
    the weights outside the stack (`gathered` of them all, whole, less the stack's),
    all in the compute dtype. Of the weights outside the stack, the largest only:
    a device runs the embedding on the first stage and the head on the last, in
    branches of the engine's ticks that share their memory (the 70B pipeline's
    TPU program holds one 1.05 B-parameter table whole, not two)."""
    dims = facts.dims
    blocks, specs = loss.stack(params).blocks, loss.stack(layout.params).blocks
    drop = frozenset(dims.batch_axes)
    stack_whole = per_device_bytes(blocks, specs, facts.mesh, drop)
    stack_split = per_device_bytes(blocks, specs, facts.mesh)
    rows = max(1, loss.stack_of(params).depth // facts.mesh.shape.get("pipe", 1))
    rest = gathered - (stack_whole - stack_split)
    in_stack = {id(x) for x in jax.tree.leaves(blocks)}
    flat = jax.tree.structure(params).flatten_up_to(layout.params)
    outside = [
        nbytes(x) // split_count(s, facts.mesh, drop) - nbytes(x) // split_count(s, facts.mesh)
        for x, s in zip(jax.tree.leaves(params), flat, strict=True)
        if is_array_like(x) and id(x) not in in_stack
    ]
    # Every weight outside the stack but the largest is another stage's.
    rest -= sum(outside) - max(outside, default=0)
    stored = next((x.dtype for x in jax.tree.leaves(blocks) if jnp.issubdtype(x.dtype, jnp.floating)), None)
    scale = (
        1.0
        if dims.compute_dtype is None or stored is None
        else itemsize(dims.compute_dtype) / itemsize(stored)
    )
    return int(scale * (2 * stack_whole // rows + max(0, rest)))


def _engine_runs(sched: Any) -> list[dict[str, bool]]:
    """What the ticks of each position of the engine's loops (`tick_loops`, one
    `lax.switch` each) do: whether any reads a residual slot (`"reads"`) or writes one
    (`"writes"`), the same for the split backwards' stash (`"stash_reads"`,
    `"stash_writes"`), and whether any runs a forward that stores its residuals
    (`"forward"`) or a backward action (`"backward"`). The engine copies a slot
    out of (into) its buffers only at positions that read (write) one."""
    program, branch_keys = build_program(sched, True)

    runs = []
    for loop in tick_loops(sched, program):
        for position in range(loop.period):
            part = program[list(loop.ticks(position))]
            keys = {key for i in set(part[..., 0].flat) for key in branch_keys[int(i)]}
            runs.append(
                {
                    "reads": slot_used(part, RES_READ),
                    "writes": slot_used(part, RES_WRITE),
                    "stash_reads": slot_used(part, STASH_READ),
                    "stash_writes": slot_used(part, STASH_WRITE),
                    "forward": any(stores_residuals(key[0], key[3]) for key in keys),
                    "backward": any(key[0] in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) for key in keys),
                }
            )
    return runs


def _backward_working_set(stacked: int, layers: int, layer: int, chunk_grads: int) -> int:
    """What a backward action holds in its branch besides the slots, from the
    bytes of a slot's `stacked` part (the residuals of a stage's `layers`
    scanned layers), of one layer's residuals without remat (`layer`) and of one
    virtual stage's weight gradients (`chunk_grads`): the stacked residuals
    unpacked as the layer scan's inputs (a scan over one layer is inlined, its
    inputs read in place), one layer's cotangents and what a remat policy
    recomputes (about one layer's residuals without remat), and the stage's
    weight gradients before they are added to the sums."""
    return (stacked if layers > 1 else 0) + layer + chunk_grads


def _run_transients(run: dict[str, bool], slot: int, stash: int, backward: int) -> int:
    """What a tick of `run` (`_engine_runs`) holds beside the loop's carry: the
    slot written, the `lax.switch`'s output (a forward's residuals packed into
    one vector per group, or zeros; the same for a split backward's stash),
    which XLA holds through the branch; beside it the larger of a forward's
    fresh residuals before they are packed (a slot) and a `backward` action's
    working set. A slot read is read in place from the buffers inside the
    branch (the backward's working set holds what it unpacks). A fused tick
    runs its forward, then its backward with the packed slot held: the same
    bound. (Measured on XLA:CPU buffer assignments of 1F1B ticks.)"""
    held = slot * run["writes"] + stash * run["stash_writes"]
    return held + max(slot if run["forward"] else 0, backward if run["backward"] else 0)


def _kept_inputs(facts: PlanFacts, analysis: Analysis) -> int:
    """Whole-sequence inputs some layouts keep per layer for the backward pass:
    under sequence parallelism the all-gathered inputs of the attention and MLP
    blocks, under all-gather context attention the gathered keys and values."""
    dims = facts.dims
    t, c = dims.tensor_size, dims.context_size
    rows = analysis.batch_size // dims.batch_size_multiple
    row = analysis.row_bytes
    kept = 0
    if dims.sequence_parallel and t > 1:
        kept += 2 * analysis.layers * rows * row // c
    if c > 1 and dims.context_attention_run == "allgather":
        kept += 2 * analysis.layers * rows * row // (t if dims.sequence_parallel or t > 1 else 1)
    return kept


def _rate(profile: DeviceProfile, mesh: Mesh, axes: tuple[str, ...]) -> float:
    # The slowest link a collective over `axes` crosses: a group spans a node when
    # its devices (their product, at the innermost axis's stride) do not fit one.
    names = list(mesh.axis_names)
    group = math.prod(mesh.shape[a] for a in axes)
    inner = max(names.index(a) for a in axes)
    stride = math.prod(mesh.shape[a] for a in names[inner + 1 :])
    outer = min(names.index(a) for a in axes)
    span = math.prod(mesh.shape[a] for a in names[outer:])
    return profile.link(group, max(stride, span // group))


def _wire(
    facts: PlanFacts,
    least: Minimum,
    analysis: Analysis,
    *,
    moved: Any,
    auto_fsdp: bool,
    sent: int | None,
    repeats: int,
    scatters: bool = False,
    ragged: bool = False,
) -> tuple[dict[str, int], dict[tuple[str, ...], int]]:
    """Wire bytes by kind and by axes: `least` (`minimum_comm`, automatic FSDP
    counted as gathering twice) plus what eqxpar's implementations move beyond
    it: a pipeline's boundary sends as its engine makes them (`sent`, the
    busiest device's, `_engine_sends`; None without a pipeline); ring attention
    re-sends keys and values; dropless expert parallelism sends the routed rows
    (`ragged`: a ragged all-to-all) or `n` times them (padded buffers), plus the
    counts per expert; automatic FSDP all-reduces; column-parallel
    weights sharing an input sum apart (`repeats`, `_repeated_sums`). With
    `scatters` (the TPU compiler) automatic FSDP reduce-scatters its gradients
    as the minimum does, instead of all-reducing them."""
    dims = facts.dims
    wire: dict[str, int] = defaultdict(int)
    by_axis: dict[tuple[str, ...], int] = defaultdict(int)

    def add(kind: str, axes: tuple[str, ...], w: float | int) -> None:
        wire[kind] += int(w)
        by_axis[axes] += int(w)

    p, m, v = facts.mesh.shape.get("pipe", 1), dims.microbatches, dims.chunks
    ring = dims.context_size > 1 and dims.context_attention_run == "ring" and not dims.pipelined
    if repeats:
        # Per-weight backward sums (see `_repeated_sums`); in a pipeline each device
        # runs them in its own backwards only, as it runs its other tensor sums
        # (`collective_stats` counts each device's own branch of a tick).
        add("all-reduce", (dims.tensor_axis,), repeats)
    for cost in least.costs:
        kind, axes, w = cost.kind, cost.axes, cost.wire_bytes
        if sent is not None and cost.source == PIPELINE_BOUNDARIES:
            # The engine sends a boundary buffer each way on the ticks it sends on, idle or not.
            sends = max(boundary_sends(p, v, m, pipeline_placement(dims)))
            add(kind, axes, w * sent / sends)
        elif ring and cost.source == CONTEXT_KEYS_VALUES:
            # The ring passes K/V blocks forward and again in the backward pass
            # (the minimum's parts), and their gradients back: all as permutes.
            add("collective-permute", axes, w)
        elif cost.source == MOE_DISPATCH and dims.expert_size > 1:
            n = dims.expert_size
            # Padded static buffers: room for all of a device's rows going to one other.
            add(kind, axes, w if ragged else w * n)
        elif cost.source == TENSOR_SUMS and dims.sequence_parallel:
            # Sequence parallel: each sum is a reduce-scatter and an all-gather
            # (ring permutes with `tp_overlap`), the same wire bytes in all.
            for k in ("all-gather", "reduce-scatter"):
                add("collective-permute" if dims.tp_overlap else k, axes, w / 2)
        elif auto_fsdp and kind == "reduce-scatter" and not scatters:
            add("all-reduce", axes, 2 * w)
        else:
            add(kind, axes, w)
    return dict(wire), dict(by_axis)


class _Repeats(TensorSumWalk):
    """A jaxpr walk that also keeps the backward sums `minimum_comm` counts once
    per input: those of a second, third, ... column-parallel weight on one input."""

    def __init__(self, moved: Any) -> None:
        super().__init__(moved=moved)
        self.repeats: list = []

    def dot(self, eqn: Any, ins: list, alias: dict, count: int) -> None:
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        if (lhs is None) != (rhs is None) and (lhs or rhs):
            dims, contract, act = (rhs, rc, eqn.invars[0]) if rhs is not None else (lhs, lc, eqn.invars[1])
            if not dims & set(contract) and alias.get(act, act) in self.seen:
                self.repeats.append(TensorSum("backward", count, aval_bytes(act.aval, self.moved)))
        super().dot(eqn, ins, alias, count)


def _repeated_sums(facts: PlanFacts, params: Any, loss: Any, batch: Any, moved: Any) -> int:
    """Wire bytes one device spends, beyond `minimum_comm`, on the backward sums
    of column-parallel weights that share an input, without sequence parallelism
    in manual mode (pipelines included): `column_matmul` multiplies the input by
    each weight apart, so each product's input cotangent is summed on its own
    (separate Q, K and V weights, as grouped-query attention has, sum three
    times where a fused QKV weight sums once). Under sequence parallelism the
    weights share one gather, whose transpose sums once."""
    dims = facts.dims
    t = dims.tensor_size
    manual = dims.mode == "manual" or dims.schedule is not None
    split = tensor_split_dims(facts, params) if t > 1 and manual and not dims.sequence_parallel else {}
    if not split or loss is None or batch is None:
        return 0
    model, data = compute_outline(dims.compute_dtype, params), compute_outline(dims.compute_dtype, batch)

    def repeats(fn: Any, args: tuple, per_device: int, num: int, den: int) -> int:
        closed, _, _ = trace_jaxpr(fn, args, "the loss")
        walk = _Repeats(moved)
        walk.run(closed.jaxpr, {closed.jaxpr.invars[i]: d for i, d in split.items() if d}, {}, 1)
        items = sum_items(walk.repeats, t, per_device=per_device, axis=dims.tensor_axis, repeat=(num, den))
        return sum(i.wire for i in items)

    if dims.schedule is None:
        share = dims.batch_size_multiple * dims.context_size
        return repeats(with_key(loss), (model, data), share, 1, 1)
    p, m = facts.mesh.shape.get("pipe", 1), dims.microbatches
    share = dims.batch_size_multiple * m * dims.context_size
    _, h, _ = trace_jaxpr(loss.first, (model, data), "loss.first(model, batch)")
    stack = repeats(lambda mod, x: loss.stack_of(mod)(x), (model, h), share, m, p)
    first = repeats(loss.first, (model, data), share, m, 1)
    last = repeats(loss.last, (model, h, data), share, m, 1)
    return stack + max(first, last)


def _auto_fsdp(dims: ParallelDims, specs: Any) -> bool:
    # Weights split over batch axes (`specs`: the parameters') in a step the compiler partitions.
    if dims.mode == "manual" or dims.schedule is not None or dims.zero1:
        return False
    batch = set(dims.batch_axes)
    return any(
        isinstance(s, PartitionSpec) and any(batch & set(mesh_axis_names(e)) for e in s)
        for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    )
