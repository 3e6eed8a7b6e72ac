"""The pipeline engine: loops over a schedule's ticks inside `shard_map`.
Shared with `eqxpar._train._step` (which runs `pipeline_gradients` and refuses what
`check_pipeline_step` refuses) and `eqxpar._advise` (which traces a device's
setup, `Engine` and `Device`, for the engine's own residual slot layout):
internal names, not public API.

Every device runs the same program. At each tick it reads its row of the schedule
(micro-batch, chunk, action, buffer slots; in a fused tick a forward and a
backward-direction action, run one after the other), runs it in a `lax.switch`
branch, then, outside the branches, sends what is due: an activation to the next
device along `pipe`, a cotangent to the previous one (`ppermute`), from exactly
the devices that have one to send, and files what it received into its buffers.
The send pairs are static, so the ticks are run in loops over repeating patterns
of sends and branches (`tick_loops`): GPipe's steady forward phase is one loop of one tick,
zero-bubble's steady state one loop of three ticks, the fill and drain ticks
loops of one iteration. The collectives of the stage body itself
(tensor-parallel all-reduces) run inside the branches: all devices of a tensor
group share their `pipe` index, hence their schedule column, hence their branch.

- Forward (`F`) of virtual stage `k`: `first` on the micro-batch (stage 0) or the
  buffered input, then the chunk's layers; the result is sent on (on the last
  stage, `last` gives the loss). Where the schedule puts the last stage's
  forward in the tick of its backward, it runs inside the backward instead
  (`Buffers.folded`).
- Backward (`B`): the stage's `jax.vjp` pulled back from the received cotangent
  (or from `1 / microbatches` on the last stage); the input cotangent is sent
  back, the parameter gradients added to the carry. Under every remat policy but
  `"full"` the forward stored its residuals in a buffer slot and the backward
  reads them: no forward runs again (the pull-back is traced anew and its
  residuals swapped for the stored ones, so the forward traced with it feeds
  nothing and XLA removes it). Under `"full"` the stage forward is recomputed
  from the buffered input, which is then all a stage keeps.
- Backward-input (`I`) and backward-weight (`W`): the same pull-back taken with
  respect to the stage input only, and to the parameters only, both from the one
  forward's residuals (under `"full"`, each recomputes the forward). The
  cotangent stays buffered from `I` to `W`.

Uneven stages (`Plan(stage_layers=...)`): every device's chunks are stored in
`max(stage_layers)` layer slots each (the plan's stack order), and a branch's key
holds its virtual stage's layer count: the branch slices its chunk to those
layers before the stage runs, so the padding slots run nothing and their
gradient sums stay zero; the residual and stash layouts are per (first, last,
layer count) kind of stage.

After the scan the gradients of everything outside the stack (computed on the
first or last stage only) are summed over `pipe`, and all gradients over the
data-parallel axes.

FSDP under a pipeline: weights the rules split over the data-parallel axes (e.g.
`stage_rules(rules.FSDP())`) are all-gathered once per step, before the scan, and
their gradients reduce-scattered once, after it. Gathering per tick instead would
move a stage's weights once per micro-batch and action; gathered once, a device
holds its own stage's whole weights (1 / pipe of the model) during the step,
while parameters and optimizer state stay split between steps. Under
`Plan(stage_gradients="sharded")` they are gathered at their uses instead
(`_stage_gathers`): in each action's stage function, the stack's a layer at a
time, each action's gradients reduce-scattered into sums split like the weights.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .._errors import PlanError
from .._fsdp import gather_weights, gathers_of, kept_axes, layer_gathers
from .._rules import mesh_axis_names
from .._shard_map import filter_shard_map
from .._stack_order import check_stack_order
from .._train._grad_common import LossFunction, normalised, reduce_gradient, split_microbatches
from .._train._step_layout import StepLayout
from .._varying import mark_varying, varying_axes
from .._weighted import WeightedMean
from ._actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE
from ._builtin import forward_only
from ._loss import PipelineLoss
from ._pipeline_plan import PIPE, PipelinePlan
from ._placement import DOWN, LOCAL, UP
from ._program import (
    FIELDS,
    HEAD,
    RES_READ,
    RES_WRITE,
    SEND_COTANGENT,
    SLOTS,
    STASH_READ,
    STASH_WRITE,
    Key,
    Loop,
    build_program,
    recv_column,
    send_column,
    slot_used,
    stores_residuals,
    tick_loops,
)
from ._schedule import Schedule
from ._split_backward import split_pull_back
from ._stage_gathers import StageGathers


def _int32(*indices: Any) -> tuple[jax.Array, ...]:
    """`indices` all as int32: under `jax_enable_x64` a Python int index becomes
    int64 while the program's slots are int32, and `dynamic_slice` rejects the mix."""
    return tuple(jnp.asarray(i, jnp.int32) for i in indices)


def _index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _write(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """`value` written into slot `slot` of `buffer`; slot -1: nothing arrived,
    the buffer as it is. A `lax.cond` (the slot varies by device; no collective
    runs in it), not a select of the old and new values: a select reads the
    slot it writes, and where XLA cannot order that read before the in-place
    update (in straight-line ticks) it copies the whole buffer."""
    return lax.cond(
        slot >= 0,
        lambda b, v: lax.dynamic_update_index_in_dim(b, v, jnp.maximum(slot, 0), 0),
        lambda b, v: b,
        buffer,
        value,
    )


def _add_chunk(acc: jax.Array, g: jax.Array, *, chunk: jax.Array) -> jax.Array:
    """`g`, a virtual stage's gradients, added to row `chunk` of the sums `acc`
    (`(chunks, slots, ...)`); a stage of fewer layers than slots adds to its
    first slots (the rest are padding)."""
    row = lax.dynamic_index_in_dim(acc, chunk, 0, keepdims=False)
    row = row + g if g.shape[0] == row.shape[0] else row.at[: g.shape[0]].add(g)
    return lax.dynamic_update_index_in_dim(acc, row, chunk, 0)


def _check_specs(specs: Any, loss: PipelineLoss, pipeline: PipelinePlan) -> None:
    p = pipeline.stages
    is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
    stack_specs = loss.stack(specs).blocks
    stack_ids = {id(s) for s in jax.tree.leaves(stack_specs, is_leaf=is_spec)}
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        if not is_spec(spec):
            continue
        where = jax.tree_util.keystr(path)
        in_stack = id(spec) in stack_ids
        for dim, entry in enumerate(spec):
            for axis in mesh_axis_names(entry):
                if axis == pipeline.tensor_axis or (axis == PIPE and in_stack and dim == 0):
                    continue
                if axis in pipeline.batch_axes:
                    # FSDP: gathered before the scan (gathers_of checks the layout).
                    continue
                if axis == PIPE:
                    raise PlanError(
                        f"leaf {where} has spec {spec}, splitting dimension {dim} over 'pipe'; under a "
                        "pipeline only the layer axis (dimension 0) of the pipelined stack may be split "
                        "over 'pipe'. Use eqxpar.pipeline.stage_rules(...) rather than a rule naming 'pipe'."
                    )
                raise PlanError(
                    f"leaf {where} has spec {spec}, splitting a weight over mesh axis {axis!r}; pipeline "
                    "plans split weights over 'pipe' (the stack's layers), the tensor axis and the "
                    f"data-parallel axes {pipeline.batch_axes} (FSDP) only. Drop {axis!r} from the rules."
                )
    # At pipe size 1 too: the engine runs the stack as varying over 'pipe' whatever
    # its size, and a stack left unsplit fails later in shard_map's replication check.
    for spec in jax.tree.leaves(stack_specs, is_leaf=is_spec):
        if is_spec(spec) and (len(spec) == 0 or mesh_axis_names(spec[0]) != (PIPE,)):
            raise PlanError(
                f"the pipelined stack's layer axis must be split over 'pipe' (size {p}), but a stack "
                f"leaf has spec {spec}. Wrap the plan's rules: rules=eqxpar.pipeline.stage_rules("
                "<your rules>), or map the logical axis 'layers' to 'pipe' in a rules.Logical."
            )


def check_pipeline_step(loss_fn: Any, pipeline: PipelinePlan, *, accumulate: int, has_aux: bool) -> None:
    """Refuse, when the step is built, what a pipeline step (`pipeline`: its plan's
    `PipelinePlan`) cannot run."""
    if not isinstance(loss_fn, PipelineLoss):
        raise PlanError(
            f"Plan(schedule={pipeline.name!r}) runs the model's stack itself, so the loss must be an "
            f"eqxpar.pipeline.PipelineLoss(first, stack, last), got {type(loss_fn).__name__}. Split "
            "the loss where the stack starts and ends."
        )
    if has_aux:
        raise PlanError("pipeline plans do not support has_aux=True yet; return the loss alone.")
    if accumulate != 1:
        raise PlanError(
            f"make_step(accumulate={accumulate}) with a pipeline plan: the pipeline already splits the "
            f"batch; set Plan(microbatches={pipeline.microbatches * accumulate}) instead of accumulate."
        )
    if pipeline.ring_tensor_matmuls:
        raise PlanError(
            f"Plan(schedule={pipeline.name!r}, tp_overlap=True): a pipeline stage runs its tensor-parallel "
            "collectives inside the schedule's branches, where only the devices of one stage meet; the "
            "ring collective matmuls of tp_overlap are collective-permutes over the whole mesh, which "
            "would wait for devices running another stage's branch and hang. Set tp_overlap=False "
            "(sequence_parallel=True still applies)."
        )


@dataclasses.dataclass(frozen=True)
class Engine:
    """What every device's program shares: the schedule's program, the loss, and
    the axes the gradients are reduced over."""

    loss: LossFunction
    layout: StepLayout
    #: Run the schedule's forward actions only (evaluation): no backward, no
    #: residuals, the last stage's forwards sum the loss.
    forward_only: bool = False

    @property
    def parts(self) -> PipelineLoss:
        return self.loss.fn

    @property
    def pipeline(self) -> PipelinePlan:
        return self.layout.resolved.pipeline

    @functools.cached_property
    def sched(self) -> Schedule:
        sched = self.pipeline.table
        return forward_only(sched) if self.forward_only else sched

    @functools.cached_property
    def program(self) -> tuple[np.ndarray, list[tuple[Key, Key]]]:
        return build_program(self.sched, self.keep, self.pipeline.stage_layers)

    @property
    def keep(self) -> bool:
        """Whether a stage's forward keeps its residuals for the backward actions
        (every remat policy but `"full"`, which recomputes the stage forward from
        the kept input in each backward action); none without a backward."""
        return self.pipeline.keeps_residuals and not self.forward_only

    @property
    def local(self) -> frozenset[str]:
        # Parameters are marked varying over pipe and the batch axes, so that each
        # device's gradients stay its own (no implicit all-reduce inside the
        # branches); they are reduced once, after the scan.
        return frozenset(self.layout.reduced_axes) | {PIPE}

    def blocks_of(self, tree: Any) -> Any:
        return self.parts.stack(tree).blocks

    def check_depth(self, model: Any) -> None:
        """Refuse a stack not stored in the plan's order (`Plan.stack_order`): the
        layers would run permuted, or the stages would be cut at the wrong rows."""
        check_stack_order(self.parts.stack_of(model), self.layout.resolved)

    def _device(self, model: Any, batch: Any) -> tuple["Device", Any, Any]:
        """This device's `Device`, with its weights made whole (FSDP) and marked
        varying; and the gathers of each weight (None where not floating-point)."""
        params, static = eqx.partition(model, eqx.is_inexact_array)
        # FSDP shards made whole once for the step; `gathers` mirrors `params`.
        mesh = self.layout.plan.mesh
        split_axes = tuple(a for a in self.layout.reduced_axes if mesh.shape[a] > 1)
        gathers = jax.tree.map(
            lambda x, spec: (
                None
                if x is None
                else gathers_of(
                    spec,
                    split_axes,
                    where=f"a weight of shape {x.shape} under a pipeline",
                    unsplit=self.layout.unsplit_axes,
                )
            ),
            params,
            self.layout.params,
            is_leaf=lambda x: x is None,
        )
        uses = None
        if self.sharded(split_axes):
            # Plan(stage_gradients="sharded"): the shards stay shards; each
            # action's stage gathers them where it uses them.
            uses = StageGathers(
                params, self.layout.params, self.blocks_of, split_axes, unsplit=self.layout.unsplit_axes
            )
        else:
            params = jax.tree.map(
                lambda x, g: x if x is None else gather_weights(x, g),
                params,
                gathers,
                is_leaf=lambda x: x is None,
            )
        params = jax.tree.map(lambda x: mark_varying(x, self.local), params)
        return Device(self, params, static, batch, uses), params, gathers

    def sharded(self, split_axes: tuple[str, ...]) -> bool:
        """Whether the weights are gathered at their uses and their gradients summed
        split (`Plan(stage_gradients="sharded")` over batch axes of size > 1)."""
        return self.pipeline.sharded_gradients and bool(split_axes)

    def loss_per_device(self, model: Any, batch: Any) -> jax.Array | WeightedMean:
        """The mean loss of the batch (forward actions only): summed over the
        last stage's micro-batches, averaged over the batch axes; a weighted
        mean's sums over the whole batch."""
        device, _, _ = self._device(model, batch)
        loss_sum, _, _ = device.run()
        axes = self.layout.reduced_axes
        if device.weighted:
            return self.weighted_sums(loss_sum, device)
        loss = lax.psum(loss_sum, PIPE) / self.sched.microbatches
        return lax.pmean(loss, axes) if axes else loss

    def weighted_sums(self, loss_sum: jax.Array, device: "Device") -> WeightedMean:
        """The whole batch's (total, weight) from this device's sums over its
        micro-batches: added over pipe (the last stage's) and over the reduced
        axes along which the loss differs between devices."""
        axes = self.layout.reduced_axes
        over = tuple(a for a in axes if a in device.loss_varies)
        sums = lax.psum(loss_sum, (PIPE, *over))
        # Along the other reduced axes every device holds the same sums (the
        # loss summed there itself), typed as differing: their mean is them.
        same = tuple(a for a in axes if a not in over)
        sums = lax.pmean(sums, same) if same else sums
        return WeightedMean(sums[0], sums[1])

    def per_device(self, model: Any, batch: Any) -> tuple[jax.Array, Any]:
        device, params, gathers = self._device(model, batch)
        loss_sum, g_rest, g_blocks = device.run()
        # Experts split over `expert` were not gathered: their gradients are whole
        # there already (`kept_axes`), so they are not summed over it.
        kept = jax.tree.map(
            lambda x, spec: None if x is None else kept_axes(spec),
            params,
            self.layout.params,
            is_leaf=lambda x: x is None,
        )
        gathers = jax.tree.map(
            lambda x, g, k: None if x is None else (g, k),
            params,
            gathers,
            kept,
            is_leaf=lambda x: x is None,
        )
        if device.weighted:
            # Gradients of the totals: summed (divide 1), then divided by the weight.
            sums = self.weighted_sums(loss_sum, device)
            _, grads = self.reduce(loss_sum[0], g_rest, g_blocks, gathers, 1)
            return normalised(sums, grads)
        return self.reduce(loss_sum, g_rest, g_blocks, gathers, self.layout.loss_divisor(device.loss_varies))

    def reduce(
        self, loss_sum: jax.Array, g_rest: Any, g_blocks: Any, gathers: Any, divide: int
    ) -> tuple[jax.Array, Any]:
        """The step's loss and gradients from the per-device sums: the rest's
        gradients (computed on the first or last stage only) summed over pipe, the
        stack's kept by the stage that owns the layers, all reduced over the
        batch axes (reduce-scattered where they were gathered), divided by `divide`.
        The rest's sum over pipe and over the batch axes is one all-reduce over
        both (two would send more)."""
        axes = self.layout.reduced_axes
        mesh = self.layout.plan.mesh
        # Sharded sums arrive reduce-scattered already (each action's gathers
        # transposed): only the other axes remain to sum over.
        scattered = self.sharded(tuple(a for a in axes if mesh.shape[a] > 1))
        loss = lax.psum(loss_sum, PIPE) / self.pipeline.microbatches
        g_blocks = jax.tree.map(lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), g_blocks)
        in_rest = eqx.tree_at(
            self.blocks_of, jax.tree.map(lambda _: True, g_rest), jax.tree.map(lambda _: False, g_blocks)
        )
        grads = eqx.tree_at(self.blocks_of, g_rest, g_blocks)
        if self.layout.trainable is not None:
            # Frozen weights (`make_step(trainable=...)`): the stages' backward
            # computes their gradients with the others', but none is reduced or
            # leaves the step.
            grads = eqx.filter(grads, self.layout.trainable)

        def reduce(g: jax.Array, gather_kept: Any, rest_leaf: bool) -> jax.Array:
            # Reduce-scatter over the axes the weight was gathered over (the
            # gather's transpose), then sum over the other batch axes, except those
            # it stays split over (experts), and over pipe for the rest's leaves.
            gather, kept = gather_kept
            rest = tuple(a for a in axes if a not in kept and all(a not in over for _, over in gather))
            psum_axes = ((PIPE,) if rest_leaf else ()) + rest
            if (scattered or not gather) and not psum_axes and divide == 1:
                return g
            return reduce_gradient(
                g,
                scatter=() if scattered else tuple(reversed(gather)),
                psum_axes=psum_axes,
                divide=divide,
                dtype=self.pipeline.reduce_dtype,
            )

        grads = jax.tree.map(
            lambda g, gather, rest_leaf: g if g is None else reduce(g, gather, rest_leaf),
            grads,
            gathers,
            in_rest,
            is_leaf=lambda x: x is None,
        )
        return (lax.pmean(loss, axes) if axes else loss), grads


class Packing:
    """Arrays of several layouts (one per kind of virtual stage) packed, per dtype
    and type, into one vector each, so that one buffer slot holds any kind's:
    `groups` gives each vector's size (the largest over the kinds), `layout[kind]`
    where each array sits."""

    def __init__(self):
        self.layout: dict[tuple, list] = {}
        self.groups: dict[tuple, int] = {}

    def add(self, kind: tuple, outlines: list) -> None:
        offsets: dict[tuple, int] = {}
        layout = []
        for leaf in outlines:
            key = (jnp.dtype(leaf.dtype).name, tuple(sorted(varying_axes(leaf))))
            start = offsets.get(key, 0)
            layout.append((key, start, leaf.shape))
            offsets[key] = start + math.prod(leaf.shape)
        self.layout[kind] = layout
        for key, size in offsets.items():
            self.groups[key] = max(self.groups.get(key, 0), size)

    def zeros(self, slots: int | None = None) -> tuple:
        """One zero vector per group (with `slots`: a buffer of that many)."""
        shape = () if slots is None else (slots,)
        return tuple(
            mark_varying(jnp.zeros((*shape, size), dtype), frozenset(axes))
            for (dtype, axes), size in sorted(self.groups.items())
        )

    def pack(self, kind: tuple, arrays: list) -> tuple:
        """`kind`'s arrays as one vector per group."""
        parts: dict[tuple, list] = {key: [] for key in self.groups}
        for (key, _, _), leaf in zip(self.layout[kind], arrays, strict=True):
            parts[key].append(leaf.reshape(-1))
        out = []
        for zero, ((dtype, axes), size) in zip(self.zeros(), sorted(self.groups.items()), strict=True):
            used = sum(x.size for x in parts[(dtype, axes)])
            pieces = parts[(dtype, axes)] + ([zero[: size - used]] if used < size else [])
            out.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        return tuple(out)

    def load(self, buffers: tuple, kind: tuple, slot: jax.Array) -> list:
        """`kind`'s arrays read from slot `slot` of `buffers` (a buffer per group)."""
        by_key = dict(zip(sorted(self.groups), buffers, strict=True))
        return [
            lax.dynamic_slice(by_key[key], _int32(slot, start), (1, math.prod(shape))).reshape(shape)
            for key, start, shape in self.layout[kind]
        ]


class TickBuffers(NamedTuple):
    """What a tick's actions read from and add to, on one device: the received
    activations and cotangents (`inputs`, `cots`), the residual and stash buffers
    (`stored`, `stashed`), the gradient sums of the rest and of the stack's chunks
    (`g_rest`, `g_blocks`) and the loss sum."""

    inputs: Any
    cots: Any
    stored: tuple
    stashed: tuple
    g_rest: Any
    g_blocks: Any
    loss_sum: Any


class PullBack(NamedTuple):
    """A backward action's operands: the chunk's parameters, its input activation
    (None on the first stage), the micro-batch and the cotangent it pulls back."""

    chunk: Any
    x: Any
    mb: Any
    seed: Any


class Device:
    """One device's step: its parameters split into the rest and its chunks, its
    micro-batches, the types of what crosses stages, and the scan over ticks."""

    def __init__(self, engine: Engine, params: Any, static: Any, batch: Any, uses: StageGathers | None):
        pipeline = engine.pipeline
        self.engine, self.static = engine, static
        # Plan(stage_gradients="sharded"): the gathers each stage runs where it
        # uses its weights (None: the weights are whole already).
        self.uses = uses
        # The weights the stage function traced last gathered (see `_vjp`).
        self._gathered: list[Any] = []
        self.p, self.v, self.m = pipeline.stages, pipeline.chunks, pipeline.microbatches
        blocks = engine.blocks_of(params)
        self.rest = eqx.tree_at(engine.blocks_of, params, jax.tree.map(lambda _: None, blocks))
        # (v * n, ...) -> (v, n, ...): chunk c of this device is row c.
        self.blocks = jax.tree.map(lambda x: x.reshape(self.v, x.shape[0] // self.v, *x.shape[1:]), blocks)
        self.static_blocks = engine.blocks_of(static)
        self.micro_batches = split_microbatches(engine.loss.compute(batch), self.m)
        # One branch function per (actions, stores), shared by every loop
        # position that runs it: JAX caches a branch's trace by the function,
        # so each is traced once, not once per tick position.
        self._branches: dict[tuple, Any] = {}
        self._resolve_types()
        if uses is not None:
            self._find_uses()
        self._resolve_residuals()

    def layers_of(self, chunk: Any, layers: int | None) -> Any:
        """The first `layers` slots of a chunk (`Plan(stage_layers=...)`: the
        stage's layers; the slots after them are padding); None: all of them.
        Sliced before the stage runs, so that the padding costs no FLOPs and,
        outside the differentiated function, gets no gradient."""
        return chunk if layers is None else jax.tree.map(lambda x: x[:layers], chunk)

    def assemble(self, rest: Any, chunk: Any) -> Any:
        full = eqx.combine(rest, self.static)
        # The chunk's rows are its stage's layers in order: a stack of its own.
        return eqx.tree_at(
            self.engine.parts.stack,
            full,
            replace_fn=lambda s: s.with_rows(eqx.combine(chunk, self.static_blocks)),
        )

    def at_use(self, rest: Any, chunk: Any, first: bool, last: bool) -> tuple[Any, dict]:
        """Under `Plan(stage_gradients="sharded")`: `rest` gathered whole where the
        stage's ends (`first`, `last`) read it, and the per-layer gathers of
        `chunk` for `layer_gathers`; else `(rest, {})`. Called inside the
        differentiated function, so the gradients come back reduce-scattered,
        split like the weights."""
        if self.uses is None:
            return rest, {}
        rest, self._gathered = self.uses.gather_rest(rest, first=first, last=last)
        return rest, self.uses.per_layer(chunk, self.static_blocks)

    def stage(
        self, rest: Any, chunk: Any, x: Any, mb_batch: Any, first: bool, last: bool, *, cast: bool = True
    ) -> Any:  # an array; anything else is refused by `_resolve_types`, naming the fix
        """Virtual stage `chunk` on one micro-batch: `first` (on the first stage),
        the chunk's layers, then `last` (on the last stage: the loss). `cast=False`:
        the weights are in the compute dtype already."""
        loss, parts = self.engine.loss, self.engine.parts
        # Mixed precision as in the other steps: the cast sits inside the
        # differentiated function, so gradients come back in the parameters'
        # dtype; activations travel in the compute dtype.
        rest, chunk = loss.compute((rest, chunk)) if cast else (rest, chunk)
        rest, per_layer = self.at_use(rest, chunk, first, last)
        model = self.assemble(rest, chunk)
        with layer_gathers(per_layer):
            if first:
                # As varying as the stage's weights (it is, unless `first` uses no
                # weight), so the stack's scan carry keeps one type.
                x = mark_varying(parts.first(model, mb_batch), self.engine.local)
            h = parts.stack(model)(x, **parts.stack_inputs(mb_batch))
            if not last:
                return h
            out = loss.loss_dtype(parts.last(model, h, mb_batch))
        if isinstance(out, WeightedMean):
            # One array crosses the schedule's buffers and seeds: (total, weight).
            return jnp.stack([out.total, out.weight.astype(out.total.dtype)])
        return out

    def _resolve_types(self) -> None:
        # The types of an activation and of the loss, from abstract evaluation.
        local, parts = self.engine.local, self.engine.parts
        mb0, chunk0 = _index(self.micro_batches, jnp.asarray(0)), _index(self.blocks, jnp.asarray(0))
        act = jax.eval_shape(lambda r, c, b: self.stage(r, c, None, b, True, False), self.rest, chunk0, mb0)

        def first_only(rest, mb):
            rest, per_layer = self.at_use(rest, chunk0, True, False)
            with layer_gathers(per_layer):
                return parts.first(self.assemble(rest, chunk0), mb)

        first_out = jax.eval_shape(first_only, self.rest, mb0)
        if not isinstance(act, jax.ShapeDtypeStruct):
            raise PlanError(
                "the pipelined stack returns "
                f"{jax.tree.structure(act)}, not one array: stages pass one activation array to each "
                "other. Blocks that also return auxiliary values (e.g. mixture-of-experts blocks "
                "returning (h, aux)) cannot be pipelined; drop the aux inside the block (or fold an aux "
                "loss into the activations), or use a plan without a pipeline."
            )
        if not isinstance(first_out, jax.ShapeDtypeStruct) or first_out.shape != act.shape:
            raise PlanError(
                "PipelineLoss.first must return one array, the activations the stack maps to the same "
                f"shape; got {first_out} from first and {act} from the stack."
            )
        self.act, self.act_axes = act, varying_axes(act) | varying_axes(first_out) | local

        def last_only(rest, mb):
            # The end's weights as the stage reads them (gathered at their use
            # under Plan(stage_gradients="sharded")).
            rest, per_layer = self.at_use(rest, chunk0, False, True)
            with layer_gathers(per_layer):
                return parts.last(self.assemble(rest, chunk0), self.zeros_act(), mb)

        last_out = jax.eval_shape(last_only, self.rest, mb0)
        #: `last` returns a weighted mean: the loss sums are (total, weight).
        self.weighted = isinstance(last_out, WeightedMean)
        loss_type = jax.eval_shape(
            lambda r, c, b: self.stage(r, c, self.zeros_act(), b, False, True), self.rest, chunk0, mb0
        )
        if loss_type.shape != ((2,) if self.weighted else ()):
            raise PlanError(
                "PipelineLoss.last must return a scalar loss (the mean over the micro-batch), or an "
                f"eqxpar.train.WeightedMean of scalars; got {last_out}."
            )
        self.loss_type, self.loss_axes = loss_type, varying_axes(loss_type) | local
        self.loss_varies = varying_axes(loss_type)

    def _find_uses(self) -> None:
        """Which weights outside the stack `first` and `last` read, so that a stage
        gathers only its ends' (`StageGathers.find_uses`)."""
        parts, uses = self.engine.parts, self.uses
        mb0, chunk0 = _index(self.micro_batches, jnp.asarray(0)), _index(self.blocks, jnp.asarray(0))
        rest, _ = self.engine.loss.compute((self.rest, chunk0))
        uses.find_uses(
            uses.whole_outlines(rest),
            lambda r: parts.first(self.assemble(r, chunk0), mb0),
            lambda r: parts.last(self.assemble(r, chunk0), self.zeros_act(), mb0),
        )

    def _vjp(self, first: bool, last: bool, chunk: Any, x: Any, mb: Any) -> tuple:
        """`(stage output, pull-back leaves, their treedef, indices of the kept
        leaves)` of `jax.vjp` of one virtual stage, taken w.r.t. the weights in
        the compute dtype (cast outside, so the residuals hold no cast copy of
        them) and, off the first stage, the input.

        Kept: what a forward stores for the backward actions, the residuals that
        are neither the weights, the input nor the micro-batch (those are at hand
        again there) and that vary along `pipe` (computed from the weights or the
        input; what is not, comes from the micro-batch alone and is recomputed)."""
        args = self.engine.loss.compute((self.rest, chunk))
        if first:
            fn = lambda r, c: self.stage(r, c, None, mb, True, last, cast=False)  # noqa: E731
        else:
            fn = lambda r, c, x: self.stage(r, c, x, mb, False, last, cast=False)  # noqa: E731
            args = (*args, x)
        out, pull = jax.vjp(fn, *args)
        leaves, treedef = jax.tree.flatten(pull)
        # Weights gathered at their use (`Plan(stage_gradients="sharded")`) are
        # gathered again by the backward rather than stored whole.
        known = {id(a) for a in (*jax.tree.leaves((args, mb)), *self._gathered)}
        self._gathered = []
        kept = tuple(
            i
            for i, leaf in enumerate(leaves)
            if eqx.is_array(leaf) and id(leaf) not in known and PIPE in varying_axes(leaf)
        )
        return out, leaves, treedef, kept

    def _resolve_residuals(self) -> None:
        """The layouts of the residual buffers (the kept leaves of each kind of
        virtual stage that stores them: first, middle, last) and, where a
        backward is split in two, of the stash buffers (what `I` hands `W`)."""
        self.residuals, self.stash = Packing(), Packing()
        _, branch_keys = self.engine.program
        if not self.engine.keep:
            return
        # Per kind of stage: (first, last, layers).
        variants = {
            key[1:3] + key[4:] for keys in branch_keys for key in keys if stores_residuals(key[0], key[3])
        }
        split = {key[1:3] + key[4:] for keys in branch_keys for key in keys if key[0] == BACKWARD_INPUT}
        # Indexed as the branches index them, by a row of the program (which
        # varies along pipe), so that the residuals have the branches' types.
        at = lax.axis_index(PIPE) * 0
        mb0, chunk0 = _index(self.micro_batches, at), _index(self.blocks, at)
        for first, last, layers in sorted(variants, key=str):

            def kept_leaves(chunk, x, mb, first=first, last=last):
                _, leaves, _, kept = self._vjp(first, last, chunk, x, mb)
                return [leaves[i] for i in kept]

            x0, chunk = (None if first else self.zeros_act()), self.layers_of(chunk0, layers)
            self.residuals.add((first, last, layers), jax.eval_shape(kept_leaves, chunk, x0, mb0))
        for first, last, layers in sorted(split, key=str):

            def stash(chunk, x, mb, first=first, last=last):
                _, leaves, treedef, _ = self._vjp(first, last, chunk, x, mb)
                halves, inputs = split_pull_back(leaves, treedef, self.seed(last, self.zeros_act()), first)
                return halves.input_half(inputs)[1]

            x0, chunk = (None if first else self.zeros_act()), self.layers_of(chunk0, layers)
            self.stash.add((first, last, layers), jax.eval_shape(stash, chunk, x0, mb0))

    def zeros_act(self) -> jax.Array:
        return mark_varying(jnp.zeros(self.act.shape, self.act.dtype), self.act_axes)

    def seed(self, last: bool, cotangent: jax.Array | None) -> jax.Array:
        """What a backward pulls back: the received cotangent, or on the last
        stage the loss's weight in the step's mean over micro-batches."""
        if last and self.weighted:
            # The gradient of the total (the weight is a constant): the step
            # divides by the whole batch's weight once the totals are added.
            return mark_varying(jnp.asarray([1.0, 0.0], self.loss_type.dtype), self.loss_axes)
        if last:
            return mark_varying(jnp.full((), 1.0 / self.m, self.loss_type.dtype), self.loss_axes)
        return mark_varying(cotangent, self.act_axes)

    def _pull_back(self, action: int, first: bool, last: bool, operands: PullBack) -> tuple:
        """`(stage output, parameter gradients or None, input cotangent or None)` of
        a backward action: `B` both, `I` the input's only, `W` the parameters' only."""
        rest, stage = self.rest, self.stage
        chunk, x, mb, seed = operands
        if action == BACKWARD and first:
            out, pull = jax.vjp(lambda r, c: stage(r, c, None, mb, True, last), rest, chunk)
            return out, pull(seed), None
        if action == BACKWARD:
            out, pull = jax.vjp(lambda r, c, x: stage(r, c, x, mb, False, last), rest, chunk, x)
            *grads, dx = pull(seed)
            return out, grads, dx
        if action == BACKWARD_INPUT and first:
            return (stage(rest, chunk, None, mb, True, last) if last else None), None, None
        if action == BACKWARD_INPUT:
            out, pull = jax.vjp(lambda x: stage(rest, chunk, x, mb, False, last), x)
            return out, None, pull(seed)[0]
        # BACKWARD_WEIGHT
        _, pull = jax.vjp(lambda r, c: stage(r, c, x, mb, first, last), rest, chunk)
        return None, pull(seed), None

    def _pull_back_kept(
        self,
        action: int,
        kind: tuple,
        folded: bool,
        operands: PullBack,
        buffers: TickBuffers,
        fields: jax.Array,
    ) -> tuple:
        """As `_pull_back`, from the residuals the stage's forward stored (or, where
        the last stage's forward is `folded` into its backward, computing them:
        `B` and `I` run the forward there), read in place from the residual
        buffers `buffers.stored` at the slot `fields` names. Returns `(output, parameter
        gradients, input cotangent, residuals to store, stash to store)`.

        The pull-back is traced again here, and its residuals swapped for the
        stored ones: the forward traced with it then feeds nothing, and XLA
        removes it. `I` and `W` run the two halves of the pull-back
        (`_split_backward`): `I` the input cotangent's, storing the stash that
        `W`'s half, the weight cotangents', reads from the stash buffers
        `buffers.stashed`. `kind`: `(first, last, layers)`, the stage's residual layout."""
        first, last, _ = kind
        chunk, x, mb, seed = operands
        stored, stashed = buffers.stored, buffers.stashed
        out, leaves, treedef, kept = self._vjp(first, last, chunk, x, mb)
        to_store = None
        if stores_residuals(action, folded):
            to_store = self.residuals.pack(kind, [leaves[i] for i in kept])
        elif not (folded and action == BACKWARD):
            for i, value in zip(kept, self.residuals.load(stored, kind, fields[RES_READ]), strict=True):
                leaves[i] = value
            out = None
        cast = lambda g, p: g.astype(p.dtype)  # noqa: E731
        if action in (BACKWARD_INPUT, BACKWARD_WEIGHT):
            halves, inputs = split_pull_back(leaves, treedef, seed, first)
            if action == BACKWARD_INPUT:
                dx, stash = halves.input_half(inputs)
                return out, None, (None if first else dx[0]), to_store, self.stash.pack(kind, stash)
            weights = halves.weight_half(inputs, self.stash.load(stashed, kind, fields[STASH_READ]))
            grads = jax.tree.unflatten(jax.tree.structure((self.rest, chunk)), weights)
            return out, jax.tree.map(cast, grads, (self.rest, chunk)), None, to_store, None
        cts = jax.tree.unflatten(treedef, leaves)(seed)
        grads = jax.tree.map(cast, tuple(cts[:2]), (self.rest, chunk))
        dx = None if first else cts[2]
        if action == BACKWARD_INPUT:
            grads = None
        elif action == BACKWARD_WEIGHT:
            dx = None
        return out, grads, dx, to_store, None

    def _run(self, keys: tuple[Key, Key], operands: tuple, *, stores: tuple[bool, bool]) -> tuple:
        """One branch of the tick's `lax.switch`: the tick's action, then its fused
        second action (if any). Returns `(activation to send on, cotangent to send
        back, rest's gradient sum, stack's gradient sums, loss sum, residuals to
        store, stash to store)`: a fused tick pairs a forward with a
        backward-direction action, so each send comes from one of them. `stores`:
        whether any tick of the run stores residuals, a stash (if not, `()`)."""
        carry, row = operands
        # The residual and stash buffers, read where an action reads a slot:
        # copied out around the switch, a slot would be copied every tick.
        stored, stashed = carry[5], carry[6]
        inputs, cots, g_rest, g_blocks, loss_sum = carry[:5]
        buffers = TickBuffers(inputs, cots, stored, stashed, g_rest, g_blocks, loss_sum)
        send_f, send_b = self.zeros_act(), self.zeros_act()
        to_store = self.residuals.zeros() if stores[0] else ()
        to_stash = self.stash.zeros() if stores[1] else ()
        for i, key in enumerate(keys):
            fields = row[HEAD + FIELDS * i : HEAD + FIELDS * (i + 1)]
            f, b, buffers, st, sh = self._action(key, fields, buffers)
            send_f = send_f if f is None else f
            send_b = send_b if b is None else b
            to_store = to_store if st is None else st
            to_stash = to_stash if sh is None else sh
        return send_f, send_b, buffers.g_rest, buffers.g_blocks, buffers.loss_sum, to_store, to_stash

    def _action(self, key: tuple, fields: jax.Array, buffers: TickBuffers) -> tuple:
        """One action of a tick, `key` its branch key `(action, first, last, folded,
        layers)`: `(activation to send on or None, cotangent to send back or None,
        the buffers with the gradient and loss sums added to, residuals to store or
        None, stash to store or None)`."""
        action, first, last, folded, layers = key
        g_rest, g_blocks, loss_sum = buffers.g_rest, buffers.g_blocks, buffers.loss_sum
        added = lambda g_rest, g_blocks, loss_sum: buffers._replace(  # noqa: E731
            g_rest=g_rest, g_blocks=g_blocks, loss_sum=loss_sum
        )
        mb, chunk, in_slot, cot_slot = fields[0], fields[1], fields[2], fields[3]
        if action == IDLE:  # (a folded forward is idle: its backward runs it)
            return None, None, buffers, None, None
        mb_batch = _index(self.micro_batches, mb)
        chunk_params = self.layers_of(_index(self.blocks, chunk), layers)
        x = None if first else lax.dynamic_index_in_dim(buffers.inputs, in_slot, 0, keepdims=False)
        if action == FORWARD and self.engine.keep:
            out, leaves, _, kept = self._vjp(first, last, chunk_params, x, mb_batch)
            packed = self.residuals.pack((first, last, layers), [leaves[i] for i in kept])
            if last:  # the loss: nothing to send on
                loss_sum = loss_sum + mark_varying(out, self.loss_axes)
                return None, None, added(g_rest, g_blocks, loss_sum), packed, None
            return mark_varying(out, self.act_axes), None, buffers, packed, None
        if action == FORWARD:
            out = self.stage(self.rest, chunk_params, x, mb_batch, first, last)
            if last:  # forward only (evaluation): the loss
                loss_sum = loss_sum + mark_varying(out, self.loss_axes)
                return None, None, added(g_rest, g_blocks, loss_sum), None, None
            return mark_varying(out, self.act_axes), None, buffers, None, None
        cot = None if last else lax.dynamic_index_in_dim(buffers.cots, cot_slot, 0, keepdims=False)
        operands = PullBack(chunk_params, x, mb_batch, self.seed(last, cot))
        packed = stash = None
        if self.engine.keep:
            out, grads, dx, packed, stash = self._pull_back_kept(
                action, (first, last, layers), folded, operands, buffers, fields
            )
        else:
            out, grads, dx = self._pull_back(action, first, last, operands)
        send_b = None if dx is None else mark_varying(dx, self.act_axes)
        if folded and action in (BACKWARD, BACKWARD_INPUT):
            loss_sum = loss_sum + mark_varying(out, self.loss_axes)
        if grads is not None:
            g_r, g_c = grads
            g_rest = jax.tree.map(jnp.add, g_rest, g_r)
            g_blocks = jax.tree.map(functools.partial(_add_chunk, chunk=chunk), g_blocks, g_c)
        return None, send_b, added(g_rest, g_blocks, loss_sum), packed, stash

    def run(self) -> tuple[jax.Array, Any, Any]:
        """The loops over the schedule's ticks: `(loss sum, rest's gradients,
        stack's gradients per chunk)` on this device.

        One loop per repeating pattern of sends and branches (`tick_loops`): a tick
        sends an activation on only from the devices that have one due (GPipe's
        forward phase sends nothing back, its fill sends from fewer devices each
        tick), a cotangent back likewise; and each device runs the same branch
        at a loop position on every iteration. Each tick's `lax.switch` holds
        the branches its loop position runs, one per device."""
        program, branch_keys = self.engine.program
        carry = self._initial_carry()
        for loop in tick_loops(self.engine.sched, program):
            # (count, period, device, column): iteration, body position.
            part = np.array(program[loop.start : loop.stop]).reshape(
                loop.count, loop.period, *program.shape[1:]
            )
            bodies = self._loop_bodies(loop, part, branch_keys)
            rows = lax.dynamic_index_in_dim(jnp.asarray(part), lax.axis_index(PIPE), 2, keepdims=False)

            def body(carry, rows, bodies=bodies):
                for j, run_tick in enumerate(bodies):
                    carry = run_tick(carry, rows[j])
                return carry, None

            if loop.count == 1:
                # Ticks run once each are still run in a loop, of one iteration
                # on every device (a trip count XLA learns late, from the device
                # index, and then unrolls): compiled as straight-line code from
                # the start they held more at once (1F1B on a small GPT: 21 %
                # more temporaries, two residual slots).
                once = lax.axis_index(PIPE) * 0 + 1
                carry = lax.fori_loop(0, once, lambda _, c, r=rows[0]: body(c, r)[0], carry)
            else:
                carry, _ = lax.scan(body, carry, rows)
        _, _, g_rest, g_blocks, loss_sum, _, _ = carry
        return loss_sum, g_rest, g_blocks

    def _initial_carry(self) -> tuple:
        """The loops' carry: the stage-input and cotangent buffers, the gradient
        and loss sums, the residual and stash buffers."""
        buffers = self.engine.sched.buffers
        n_inputs, n_cots, n_res = (max(1, n) for n in (buffers.inputs, buffers.cotangents, buffers.residuals))
        act = self.act
        return (
            mark_varying(jnp.zeros((n_inputs, *act.shape), act.dtype), self.act_axes),
            mark_varying(jnp.zeros((n_cots, *act.shape), act.dtype), self.act_axes),
            jax.tree.map(jnp.zeros_like, self.rest),
            jax.tree.map(jnp.zeros_like, self.blocks),
            mark_varying(jnp.zeros(self.loss_type.shape, self.loss_type.dtype), self.loss_axes),
            self.residuals.zeros(n_res),
            # What a split backward's `I` hands its `W`, in slots of their own.
            self.stash.zeros(max(1, buffers.stashes)),
        )

    def _loop_bodies(self, loop: Loop, part: np.ndarray, branch_keys: list) -> list:
        """One tick function per position of `loop`'s body, each switching over the
        branches its position runs; `part` (the loop's program rows, `(count,
        period, device, column)`) gets its branch column renumbered to match."""
        bodies = []
        for j, sends in enumerate(loop.sends):
            at = part[:, j]
            # A switch of one branch is inlined (by JAX): its slot reads are
            # then no longer ordered before the tick's slot writes by the
            # switch's output, and XLA copies whole buffers around them.
            # The idle branch keeps it a switch.
            used = sorted({int(i) for i in at[..., 0].flat} | {0})
            part[:, j, :, 0] = np.searchsorted(used, at[..., 0])
            uses = {f: slot_used(at, f) for f in SLOTS}
            stores = (uses[RES_WRITE], uses[STASH_WRITE])
            local = [self._branch(branch_keys[i], stores) for i in used]
            bodies.append(
                functools.partial(
                    self._tick,
                    local=local,
                    lanes=_lanes(at, sends),
                    uses=uses,
                    scope=self._tick_scope(part[:, j, :, 0]),
                )
            )
        return bodies

    def _branch(self, keys: tuple[Key, Key], stores: tuple[bool, bool]) -> Any:
        """The `_run` of `keys`, one function object per `(keys, stores)`."""
        if (keys, stores) not in self._branches:
            self._branches[keys, stores] = functools.partial(self._run, keys, stores=stores)
        return self._branches[keys, stores]

    def _tick_scope(self, branches: np.ndarray) -> str:
        """The name of a loop position's switch, saying which branch each device runs
        (`branches`: `(iteration, pipe position)`, the same on every iteration), so
        that `eqxpar.inspect.collective_stats` counts each device's own branch
        rather than the costliest: `eqxpar_tick_s{stride}_b{i_0}_{i_1}...`, where a
        device's position along `pipe` is its partition id // stride % pipe."""
        if not (branches == branches[:1]).all():
            return "eqxpar_tick"  # not expected (`tick_loops`); then the costliest counts
        shape = self.engine.layout.plan.mesh.shape
        names = list(shape)
        stride = math.prod(shape[a] for a in names[names.index(PIPE) + 1 :])
        return f"eqxpar_tick_s{stride}_b" + "_".join(str(int(b)) for b in branches[0])

    def _tick(
        self,
        carry: tuple,
        row: jax.Array,
        *,
        local: list,
        lanes: dict,
        uses: dict,
        scope: str,
    ) -> tuple:
        """One tick: the device's branch of `local`, then the sends along each
        lane (`_lanes`: down and up from the devices they name, the hand-over
        on the device itself), each received value filed into its slot."""
        p = self.p
        # What the tick's actions store is written into its slot here, after
        # the switch, in loop positions whose ticks store any (`uses`, per field).
        res, stash = carry[5], carry[6]

        def slot(field):  # at most one of the tick's actions has a slot there
            return jnp.maximum(row[HEAD + field], row[HEAD + FIELDS + field])

        with jax.named_scope(scope):
            send_f, send_b, g_rest, g_blocks, loss_sum, to_store, to_stash = lax.switch(
                row[0], local, (carry, row)
            )
        inputs, cots = carry[0], carry[1]
        # Every device runs the tick's sends, outside the branches (a
        # collective that only some devices reach would hang); the pairs
        # name the devices with something due.
        for at, (devices, kinds, into_inputs, into_cots) in lanes.items():
            if at == LOCAL:  # a hand-over on the device: its own outputs, no send
                got_f, got_b = send_f, send_b
            else:
                if len(kinds) == 2:  # devices of this position send either kind this way
                    value = jnp.where(row[send_column(at)] == SEND_COTANGENT, send_b, send_f)
                else:
                    value = send_b if SEND_COTANGENT in kinds else send_f
                step = 1 if at == DOWN else -1
                got_f = got_b = lax.ppermute(value, PIPE, [(d, (d + step) % p) for d in devices])
            if into_inputs:
                inputs = _write(inputs, row[recv_column(at, False)], got_f)
            if into_cots:
                cots = _write(cots, row[recv_column(at, True)], got_b)
        if uses[RES_WRITE]:
            res = tuple(_write(b, slot(RES_WRITE), v) for b, v in zip(res, to_store, strict=True))
        if uses[STASH_WRITE]:
            stash = tuple(_write(b, slot(STASH_WRITE), v) for b, v in zip(stash, to_stash, strict=True))
        return (inputs, cots, g_rest, g_blocks, loss_sum, res, stash)


def _lanes(rows: np.ndarray, sends: tuple[tuple[int, ...], tuple[int, ...]]) -> dict:
    """What a loop position moves along each lane, from its program rows `rows`
    (`(iteration, device, column)`) and its senders `sends` (down, up): per lane
    that carries anything, `(sending devices, kinds they send, whether an
    activation arrives, whether a cotangent arrives)`; the local lane
    (a V's turn) sends from no device."""
    out = {}
    for at in (DOWN, UP, LOCAL):
        into = tuple(bool((rows[..., recv_column(at, c)] >= 0).any()) for c in (False, True))
        if at == LOCAL:
            if any(into):
                out[at] = ((), frozenset(), *into)
            continue
        devices = sends[0] if at == DOWN else sends[1]
        if devices:
            column = rows[..., send_column(at)]
            out[at] = (devices, frozenset(int(k) for k in column[column >= 0].flat), *into)
    return out


def pipeline_loss(loss: LossFunction, layout: StepLayout, model: Any, batch: Any) -> jax.Array | WeightedMean:
    """The mean loss of a pipeline plan over the global batch, running the
    schedule's forward actions only (`forward_only`): evaluation."""
    engine = Engine(loss, layout, forward_only=True)
    engine.check_depth(model)
    _check_specs(layout.params, loss.fn, layout.resolved.pipeline)
    return filter_shard_map(
        engine.loss_per_device,
        layout.plan,
        in_specs=(layout.params, layout.batch),
        out_specs=PartitionSpec(),
        axis_names=frozenset(layout.plan.mesh.axis_names),
    )(model, batch)


def pipeline_gradients(
    loss: LossFunction, layout: StepLayout, model: Any, batch: Any, key: Any
) -> tuple[jax.Array, None, Any]:
    """Loss and gradients of a pipeline plan over the global batch (the three
    parts of a `PipelineLoss` take no key, and return no aux). The gradients
    come out in the parameters' specs."""
    del key
    engine = Engine(loss, layout)
    engine.check_depth(model)
    plan = layout.plan
    _check_specs(layout.params, loss.fn, layout.resolved.pipeline)
    value, grads = filter_shard_map(
        engine.per_device,
        plan,
        in_specs=(layout.params, layout.batch),
        out_specs=(PartitionSpec(), layout.params),
        axis_names=frozenset(plan.mesh.axis_names),
    )(model, batch)
    return value, None, grads
