"""The pipeline engine: one `lax.scan` over a schedule's ticks inside `shard_map`.

Every device runs the same program. At each tick it reads its row of the schedule
(micro-batch, chunk, action, buffer slots), runs that action in a `lax.switch`
branch, then, outside the branches, every device sends one activation to the next
device along `pipe` and one cotangent to the previous one (`ppermute`; zeros when
there is nothing to send) and files what it received into its buffers. The
collectives of the stage body itself (tensor-parallel all-reduces) run inside the
branches: all devices of a tensor group share their `pipe` index, hence their
schedule column, hence their branch.

- Forward (`F`) of virtual stage `k`: `first` on the micro-batch (stage 0) or the
  buffered input, then the chunk's layers; the result is sent on. On the last
  stage a forward does nothing: its backward computes the loss.
- Backward (`B`): the stage forward again under `jax.vjp` (recomputed from the
  buffered input, which is all a stage keeps between its forward and its
  backward), pulled back from the received cotangent (or from `1 / microbatches`
  on the last stage); the input cotangent is sent back, the parameter gradients
  added to the carry.
- Backward-input (`I`) and backward-weight (`W`): the same pull-back taken with
  respect to the stage input only, and to the parameters only; each recomputes
  the stage forward. The cotangent stays buffered from `I` to `W`.

After the scan the gradients of everything outside the stack (computed on the
first or last stage only) are summed over `pipe`, and all gradients over the
data-parallel axes.

FSDP under a pipeline: weights the rules split over the data-parallel axes (e.g.
`stage_rules(rules.FSDP())`) are all-gathered once per step, before the scan, and
their gradients reduce-scattered once, after it. Gathering per tick instead would
move a stage's weights once per micro-batch and action; gathered once, a device
holds its own stage's whole weights (1 / pipe of the model) during the step,
while parameters and optimizer state stay split between steps.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .._errors import BatchError, DivisibilityError, PlanError
from .._fsdp import gather_weights, gathers_of
from .._plan import Plan
from .._rules import mesh_axis_names
from .._shard_map import filter_shard_map
from .._specs import partition_specs
from .._train_state import cast_floating
from ._loss import PipelineLoss
from ._schedule import BACKWARD, BACKWARD_INPUT, FORWARD, IDLE, Schedule, schedule

PIPE = "pipe"


def _varying(x: jax.Array) -> frozenset[str]:
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _cast(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    # Mark x as varying over `axes` (it may differ between those devices); the
    # carries of the scan and the outputs of the switch branches need one type.
    missing = tuple(sorted(axes - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _in_dtype(reduce: Callable, g: jax.Array, dtype: Any) -> jax.Array:
    # `Plan(reduce_dtype=...)`: gradients cross the wire in that dtype.
    if dtype is None or dtype == g.dtype:
        return reduce(g)
    return reduce(g.astype(dtype)).astype(g.dtype)


def _index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _write(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    # Slot -1 means "nothing arrived": keep the buffer as it is.
    at = jnp.maximum(slot, 0)
    current = lax.dynamic_index_in_dim(buffer, at, 0, keepdims=False)
    value = jnp.where(slot >= 0, value, current)
    return lax.dynamic_update_index_in_dim(buffer, value, at, 0)


def _program(sched: Schedule) -> tuple[np.ndarray, list[tuple[int, bool, bool]]]:
    """Per (tick, device): branch index, micro-batch, chunk, input slot, cotangent
    slot, receive-input slot, receive-cotangent slot; and the branch list
    (action, is first virtual stage, is last virtual stage)."""
    p, stages = sched.stages, sched.virtual_stages
    bufs = sched.buffers
    branches: list[tuple[int, bool, bool]] = [(IDLE, False, False)]
    index: dict[tuple[int, bool, bool], int] = {branches[0]: 0}
    table = sched.table
    prog = np.zeros(table.shape[:2] + (7,), np.int32)
    for tick in range(table.shape[0]):
        for device in range(p):
            mb, chunk, kind = (int(x) for x in table[tick, device])
            key = (IDLE, False, False)
            if kind != IDLE:
                k = chunk * p + device
                key = (kind, k == 0, k == stages - 1)
            if key not in index:
                index[key] = len(branches)
                branches.append(key)
            prog[tick, device] = (
                index[key],
                max(mb, 0),
                max(chunk, 0),
                bufs.input_slot[tick, device],
                bufs.cotangent_slot[tick, device],
                bufs.recv_input[tick, device],
                bufs.recv_cotangent[tick, device],
            )
    return prog, branches


def _check_specs(specs: Any, loss: PipelineLoss, plan: Plan) -> None:
    p = plan.mesh.shape[PIPE]
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
                if axis == plan.tensor_axis:
                    continue
                if axis == PIPE and in_stack and dim == 0:
                    continue
                if axis in plan.batch_axes:
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
                    f"data-parallel axes {plan.batch_axes} (FSDP) only. Drop {axis!r} from the rules."
                )
    if p > 1:
        for spec in jax.tree.leaves(stack_specs, is_leaf=is_spec):
            if is_spec(spec) and (len(spec) == 0 or mesh_axis_names(spec[0]) != (PIPE,)):
                raise PlanError(
                    f"the pipelined stack's layer axis must be split over 'pipe' (size {p}), but a stack "
                    f"leaf has spec {spec}. Wrap the plan's rules: rules=eqxpar.pipeline.stage_rules("
                    "<your rules>), or map the logical axis 'layers' to 'pipe' in a rules.Logical."
                )


def pipeline_gradients(loss_fn: Any, plan: Plan, *, accumulate: int, has_aux: bool) -> Callable:
    """`(model, batch, key) -> (loss, None, grads)` of a pipeline plan, for `make_step`."""
    if not isinstance(loss_fn, PipelineLoss):
        raise PlanError(
            f"Plan(schedule={plan.schedule!r}) runs the model's stack itself, so the loss must be an "
            f"eqxpar.pipeline.PipelineLoss(first, stack, last), got {type(loss_fn).__name__}. Split "
            "the loss where the stack starts and ends."
        )
    if has_aux:
        raise PlanError("pipeline plans do not support has_aux=True yet; return the loss alone.")
    if accumulate != 1:
        raise PlanError(
            f"make_step(accumulate={accumulate}) with a pipeline plan: the pipeline already splits the "
            f"batch; set Plan(microbatches={plan.microbatches * accumulate}) instead of accumulate."
        )
    if plan.tp_overlap and plan.mesh.shape[plan.tensor_axis] > 1:
        raise PlanError(
            f"Plan(schedule={plan.schedule!r}, tp_overlap=True): a pipeline stage runs its tensor-parallel "
            "collectives inside the schedule's branches, where only the devices of one stage meet; the "
            "ring collective matmuls of tp_overlap are collective-permutes over the whole mesh, which "
            "would wait for devices running another stage's branch and hang. Set tp_overlap=False "
            "(sequence_parallel=True still applies)."
        )
    p = plan.mesh.shape[PIPE]
    v, m = plan.chunks, plan.microbatches
    compute, reduce_dtype = plan.compute_dtype, plan.reduce_dtype
    sched = schedule(plan.schedule, stages=p, microbatches=m, chunks=v)
    prog_np, branch_keys = _program(sched)
    stages = p * v
    batch_axes = tuple(a for a in plan.batch_axes)
    dp = math.prod(plan.mesh.shape[a] for a in batch_axes)
    all_axes = frozenset(plan.mesh.axis_names)
    # Size-1 axes split nothing: no gather for them.
    split_axes = tuple(a for a in batch_axes if plan.mesh.shape[a] > 1)
    n_inputs = max(1, sched.buffers.inputs)
    n_cots = max(1, sched.buffers.cotangents)

    def where(tree: Any) -> Any:
        return loss_fn.stack(tree).blocks

    def per_device(model: Any, batch: Any, specs: Any) -> tuple[jax.Array, Any]:
        d = lax.axis_index(PIPE)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        # FSDP shards made whole once for the step; `gathers` mirrors `params`.
        gathers = jax.tree.map(
            lambda x, spec: (
                None
                if x is None
                else gathers_of(spec, split_axes, where=f"a weight of shape {x.shape} under a pipeline")
            ),
            params,
            specs,
            is_leaf=lambda x: x is None,
        )
        params = jax.tree.map(
            lambda x, g: x if x is None else gather_weights(x, g),
            params,
            gathers,
            is_leaf=lambda x: x is None,
        )
        # Parameters are marked varying over pipe and the batch axes, so that each
        # device's gradients stay its own (no implicit all-reduce inside the
        # branches); they are reduced once, after the scan.
        local = frozenset(batch_axes) | {PIPE}
        params = jax.tree.map(lambda x: _cast(x, local), params)
        blocks = where(params)
        rest = eqx.tree_at(where, params, jax.tree.map(lambda _: None, blocks))
        # (v * n, ...) -> (v, n, ...): chunk c of this device is row c.
        blocks = jax.tree.map(lambda x: x.reshape(v, x.shape[0] // v, *x.shape[1:]), blocks)
        static_blocks = where(static)

        def assemble(rest_params: Any, chunk_params: Any) -> Any:
            full = eqx.combine(rest_params, static)
            return eqx.tree_at(where, full, eqx.combine(chunk_params, static_blocks))

        def micro(x: jax.Array) -> jax.Array:
            # Micro-batch j takes rows j, m + j, 2m + j, ...
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:])
            return jnp.swapaxes(x, 0, 1)

        micro_batches = jax.tree.map(micro, batch if compute is None else cast_floating(batch, compute))

        def stage(rest_params, chunk_params, x, mb_batch, first: bool, last: bool):
            if compute is not None:
                # Mixed precision as in the other steps: the cast sits inside the
                # differentiated function, so gradients come back in the
                # parameters' dtype; activations travel in the compute dtype.
                rest_params, chunk_params = cast_floating((rest_params, chunk_params), compute)
            model = assemble(rest_params, chunk_params)
            if first:
                # As varying as the stage's weights (it is, unless `first` uses no
                # weight), so the stack's scan carry keeps one type.
                x = _cast(loss_fn.first(model, mb_batch), local)
            h = loss_fn.stack(model)(x)
            if not last:
                return h
            loss = loss_fn.last(model, h, mb_batch)
            return loss if compute is None else loss.astype(jnp.float32)

        # The types of an activation and of the loss, from abstract evaluation.
        mb0 = _index(micro_batches, jnp.asarray(0))
        chunk0 = _index(blocks, jnp.asarray(0))
        act = jax.eval_shape(lambda r, c, b: stage(r, c, None, b, True, False), rest, chunk0, mb0)
        first_out = jax.eval_shape(lambda r, b: loss_fn.first(assemble(r, chunk0), b), rest, mb0)
        if not isinstance(first_out, jax.ShapeDtypeStruct) or first_out.shape != act.shape:
            raise PlanError(
                "PipelineLoss.first must return one array, the activations the stack maps to the same "
                f"shape; got {first_out} from first and {act} from the stack."
            )
        act_axes = (
            frozenset(act.manual_axis_type.varying) | frozenset(first_out.manual_axis_type.varying) | local
        )

        def zeros_act() -> jax.Array:
            return _cast(jnp.zeros(act.shape, act.dtype), act_axes)

        loss_type = jax.eval_shape(
            lambda r, c, b: stage(r, c, zeros_act(), b, False, True), rest, chunk0, mb0
        )
        if loss_type.shape != ():
            raise PlanError(
                f"PipelineLoss.last must return a scalar loss (the mean over the micro-batch), got shape "
                f"{loss_type.shape}."
            )
        loss_axes = frozenset(loss_type.manual_axis_type.varying) | local

        def branch(action: int, first: bool, last: bool) -> Callable:
            def run(operands):
                carry, row = operands
                inputs, cots, g_rest, g_blocks, loss_sum = carry
                _, mb, chunk, in_slot, cot_slot, _, _ = row
                send_f, send_b = zeros_act(), zeros_act()
                if action == IDLE or (action == FORWARD and last):
                    # The last stage's forward is folded into its backward.
                    return send_f, send_b, g_rest, g_blocks, loss_sum
                mb_batch = _index(micro_batches, mb)
                chunk_params = _index(blocks, chunk)
                x = None if first else lax.dynamic_index_in_dim(inputs, in_slot, 0, keepdims=False)
                if action == FORWARD:
                    send_f = _cast(stage(rest, chunk_params, x, mb_batch, first, last), act_axes)
                    return send_f, send_b, g_rest, g_blocks, loss_sum
                if last:
                    seed = _cast(jnp.full((), 1.0 / m, loss_type.dtype), loss_axes)
                else:
                    seed = _cast(lax.dynamic_index_in_dim(cots, cot_slot, 0, keepdims=False), act_axes)
                grads = None
                if action == BACKWARD:
                    if first:
                        out, pull = jax.vjp(
                            lambda r, c: stage(r, c, None, mb_batch, True, last), rest, chunk_params
                        )
                        grads = pull(seed)
                    else:
                        out, pull = jax.vjp(
                            lambda r, c, x: stage(r, c, x, mb_batch, False, last), rest, chunk_params, x
                        )
                        *grads, dx = pull(seed)
                        send_b = _cast(dx, act_axes)
                elif action == BACKWARD_INPUT:
                    if first:
                        out = stage(rest, chunk_params, None, mb_batch, True, last) if last else None
                    else:
                        out, pull = jax.vjp(lambda x: stage(rest, chunk_params, x, mb_batch, False, last), x)
                        (dx,) = pull(seed)
                        send_b = _cast(dx, act_axes)
                else:  # BACKWARD_WEIGHT
                    out = None
                    _, pull = jax.vjp(lambda r, c: stage(r, c, x, mb_batch, first, last), rest, chunk_params)
                    grads = pull(seed)
                if last and action in (BACKWARD, BACKWARD_INPUT):
                    loss_sum = loss_sum + _cast(out, loss_axes)
                if grads is not None:
                    g_r, g_c = grads
                    g_rest = jax.tree.map(jnp.add, g_rest, g_r)
                    g_blocks = jax.tree.map(
                        lambda acc, g: lax.dynamic_update_index_in_dim(
                            acc, lax.dynamic_index_in_dim(acc, chunk, 0, keepdims=False) + g, chunk, 0
                        ),
                        g_blocks,
                        g_c,
                    )
                return send_f, send_b, g_rest, g_blocks, loss_sum

            return run

        branches = [branch(*key) for key in branch_keys]
        forward_perm = [(i, (i + 1) % p) for i in range(p)]
        backward_perm = [(i, (i - 1) % p) for i in range(p)]

        def tick(carry, row):
            send_f, send_b, g_rest, g_blocks, loss_sum = lax.switch(row[0], branches, (carry, row))
            # Every device sends every tick, outside the branches (a collective
            # that only some devices reach would hang).
            if p > 1:
                send_f = lax.ppermute(send_f, PIPE, forward_perm)
                send_b = lax.ppermute(send_b, PIPE, backward_perm)
            inputs = _write(carry[0], row[5], send_f)
            cots = _write(carry[1], row[6], send_b)
            return (inputs, cots, g_rest, g_blocks, loss_sum), None

        program = lax.dynamic_index_in_dim(jnp.asarray(prog_np), d, 1, keepdims=False)
        init = (
            _cast(jnp.zeros((n_inputs, *act.shape), act.dtype), act_axes),
            _cast(jnp.zeros((n_cots, *act.shape), act.dtype), act_axes),
            jax.tree.map(jnp.zeros_like, rest),
            jax.tree.map(jnp.zeros_like, blocks),
            _cast(jnp.zeros((), loss_type.dtype), loss_axes),
        )
        (_, _, g_rest, g_blocks, loss_sum), _ = lax.scan(tick, init, program)
        # Only the first and last stages computed the rest's gradients: sum over
        # pipe. The stack's gradients stay with the stage that owns the layers.
        g_rest = jax.tree.map(lambda g: _in_dtype(lambda g: lax.psum(g, PIPE), g, reduce_dtype), g_rest)
        loss = lax.psum(loss_sum, PIPE) / m
        g_blocks = jax.tree.map(lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), g_blocks)
        grads = eqx.tree_at(where, g_rest, g_blocks)
        if batch_axes:

            def reduce(g: jax.Array, gather: Any) -> jax.Array:
                # Reduce-scatter over the axes the weight was gathered over (the
                # gather's transpose), then sum over the other batch axes.
                for dim, axes in reversed(gather):
                    g = lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
                rest_axes = tuple(a for a in batch_axes if all(a not in axes for _, axes in gather))
                if rest_axes:
                    g = lax.psum(g, rest_axes)
                return g / dp

            grads = jax.tree.map(
                lambda g, gather: g if g is None else _in_dtype(lambda g: reduce(g, gather), g, reduce_dtype),
                grads,
                gathers,
                is_leaf=lambda x: x is None,
            )
            loss = lax.pmean(loss, batch_axes)
        return loss, grads

    def gradients(model: Any, batch: Any, key: Any) -> tuple[jax.Array, None, Any]:
        del key  # the three parts take no key
        stack = loss_fn.stack_of(model)
        depth = stack.depth
        if depth % stages:
            raise DivisibilityError(
                f"the pipelined stack has depth {depth}, which does not split into {p} stages x "
                f"{v} chunks = {stages} equal virtual stages. Use a depth that is a multiple of "
                f"{stages}, or other pipe / chunks sizes."
            )
        rows = {x.shape[0] for x in jax.tree.leaves(batch) if hasattr(x, "shape") and x.ndim}
        for size in rows:
            if size % dp or (size // dp) % m:
                raise BatchError(
                    f"batch size {size} does not split into {dp} data-parallel shards of {m} equal "
                    f"micro-batches (Plan(microbatches={m})). Use a batch size that is a multiple of "
                    f"{dp * m}, or a micro-batch count that divides {size // max(dp, 1)}."
                )
        specs = partition_specs(model, plan)
        _check_specs(specs, loss_fn, plan)
        loss, grads = filter_shard_map(
            functools.partial(per_device, specs=specs),
            plan,
            in_specs=(specs, plan.batch_spec),
            out_specs=(PartitionSpec(), specs),
            axis_names=all_axes,
        )(model, batch)
        return loss, None, grads

    return gradients
