"""What the TPU compiler holds per device in a step it partitions itself
(automatic mode, the weights split over batch axes), where that differs from
what XLA:CPU holds (`_predict`'s model).

Read off the TPU compiler's buffer assignments of Llama-3 8B and 70B and
Mixtral 8x7B steps compiled ahead of time for v5p slices (`eqxpar.aot`; the
`benchmarks.tpu_compile` records, whose tables show the prediction beside the
compiled figure; the programs' buffer assignments, live ranges and collectives
as `--xla_dump_to` writes them). What differs:

- **Gradients stay split.** The TPU compiler reduce-scatters each layer's weight
  gradient inside the backward loop as it is made (often as a windowed einsum
  that never forms it whole): a device holds the gradients' shards, in the
  parameters' dtype, not every gradient whole (XLA:CPU's program, 30 GB on 8B).
- **The stack's inputs.** Under `remat="full"` the stack's recomputed forward
  keeps each layer's input for the layers' own recomputation: one activation per
  layer per row (compute dtype; split over `tensor` under sequence parallelism,
  or where the stack splits what it keeps, `ParallelDims.split_saved_inputs`),
  which the loss's own residuals do not show (the stack saves only its input).
  Under a `RematPolicy` the forward scan keeps the same inputs (its checkpoint's
  arguments) and beside them, per layer, the values the policy names (8B, the
  query, key and value projections saved: stacked `bf16[32,1,2048,32,128]` and
  two `bf16[32,1,2048,8,128]`, live with the inputs' `bf16[32,1,2048,4096]`
  from the forward to the backward; offloaded, `_offload` takes them off).
- **The head is gathered whole.** The largest weight outside the stacks (the
  output head) is all-gathered over the batch axes for its matmul, in compute
  dtype; its backward holds it beside its gradient, whole in compute dtype
  before the reduce-scatter, the float32 logits and a compute-dtype copy of
  them. With `GPTConfig(loss_chunk=...)` the head runs in tiles of the
  vocabulary, each tile's the same, one tile at a time.
- **The weights cast once.** The layer loops read the weights in compute dtype
  from casts the compiler hoists out of them: a compute-dtype copy of every
  weight shard lives through the backward.
- **Phases.** Of a dense model's step (no MoE layer), what is live at the peak
  is the larger of the head's phase (the kept inputs and the head's working
  set), the layers' backward (the kept inputs, the gradient shards, the cast
  weights and one layer's backward) and the update (the gradient shards and
  the update's temporaries). Read off the compiled 8B and 70B programs (their
  live ranges at the peak, `--xla_dump_to`'s buffer assignment).
- **One layer's backward.** While a layer runs backward it holds its recomputed
  forward and its gradients: the attention kernel's score, probability and
  gradient blocks in float32 (`block_size` keys per block), the MLP's hidden
  activations and their gradients (gate, up, activation), and a few copies of
  the residual stream. Of an MoE model the head's phase and one layer's
  backward are not live at once: it holds the larger of the two beside what
  lives throughout (gradient shards, kept inputs, residuals, the weights cast
  to compute dtype, the update's temporaries).
- **Collectives beyond the minimum** (`extra_wire`, `pipeline_wire`). Where
  the stack keeps its layer inputs split over `tensor`
  (`ParallelDims.split_saved_inputs`), the recomputed forward all-gathers each
  layer's input over `tensor` before its first matmul (one per layer; the
  forward's own gather and the output's reduce-scatter make the all-reduce the
  minimum counts). Most FSDP matmuls run as windowed einsums, whose rings pass
  two shards more than a gather or scatter (`_windowed`). In vocabulary tiles
  each tile is gathered again in the backward and its gradient all-reduced
  where the minimum reduce-scatters it once. The embedding's lookup moves its
  table's shard and the looked-up rows by all-to-all, never gathering the table
  (`eqxpar.nn.Embedding`). A pipeline with sharded stage gradients all-reduces
  the MLP input weight's gradient each micro-batch.
- **Over several slices, gradients are all-reduced.** In a program over several
  slices joined by DCN (`make_mesh(dcn=...)`), the TPU compiler turns every
  reduce-scatter into an all-reduce and a slice (its `reduce-scatter-decomposer`
  pass, after the cross-slice rewrites; libtpu 0.0.50.1): each weight's gradient
  is all-reduced whole over the batch axes inside the slice, twice the wire of
  the minimum's reduce-scatter, and only the slice's shard crosses the slices
  (the minimum's all-reduce over `data`). It does so to eqxpar's own
  reduce-scatters too (`mode="manual"`'s), and
  `--xla_tpu_decompose_every_reduce_scatters_hlos=false` does not stop it. The
  same program windows no einsum: its weights are plain all-gathers, as the
  minimum counts them (Llama-3 8B on two and four v5p-64 slices under HSDP).
- **Plain scatters where eqxpar asks.** Under FSDP x tensor over an FSDP group
  of at most 8, eqxpar compiles with the windowed gradient scatters off
  (`eqxpar/_tpu_compiler.py`): the gradients are reduce-scattered as the minimum
  counts them, and only the gathers are windowed.
- **Experts are gathered, not windowed.** An MoE layer's expert weights (grouped
  matmuls) are all-gathered over the batch axes for the layer, in compute dtype,
  and their gradient is made whole over them and reduce-scattered in compute
  dtype, as `minimum_comm` counts (eqxpar gathers them itself, manual over the
  batch axes).
"""

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._mesh import EXPERT_AXIS
from .._remat import RematPolicy
from .._rules import mesh_axis_names
from .._sizes import itemsize
from .._slices import slice_factors
from .._specs import is_array_like
from .._tpu_compiler import plain_gradient_scatters
from ..inspect._model_layers import attention_layers, moe_layers
from ._analysis import Analysis

#: Live float32 blocks of the attention kernel's backward per query row, head and
#: key of a block: scores, probabilities and their gradient.
_SCORE_BLOCKS = 3
#: Hidden activations of a gated MLP live in its backward: gate, up, their product.
_HIDDEN_COPIES = 3
#: Residual-stream activations (d_model wide) live in a layer's backward: its
#: input, the two norms' outputs, the attention output and their gradients.
_STREAM_COPIES = 5


@dataclasses.dataclass(frozen=True)
class TpuTerms:
    """Per device: `gradients` (their shards), `inputs` (the stack's kept layer
    inputs), `head` (the head's working set: its gathered weight and gradient,
    or a tile's, and its logits), `layer` (one layer's backward), `weights` (the
    weight shards cast to compute dtype)."""

    gradients: int
    inputs: int
    head: int
    layer: int
    weights: int = 0

    def phases(self, update: int) -> int:
        """A dense step's temporaries: the largest of its phases (see the
        module), with `update` the optimizer update's temporaries."""
        backward = self.inputs + self.gradients + self.weights + self.layer
        return max(self.inputs + self.head, backward, self.gradients + update)


def tpu_terms(
    dims: Any, mesh: Any, analysis: Analysis, params: Any, specs: Any, gradients: int, *, named: int = 0
) -> TpuTerms:
    """The four terms (see the module) of a step under `dims` (`ParallelDims`) on
    `mesh`, with `params` and their `specs` (the step layout's) as outlines;
    `gradients`: the parameters' bytes per device (their shards), in the
    parameters' dtype; `named`: under a `RematPolicy`, the bytes per device of
    the values it keeps beyond the layers' inputs (saved or offloaded, every
    layer's)."""
    compute = dims.compute_dtype
    attention = attention_layers(params)
    t, c = dims.tensor_size, dims.context_size
    rows = max(1, analysis.batch_size // dims.batch_size_multiple)
    seq = (analysis.seq_len or 1) // c
    head = _head(params, specs, mesh, dims, compute, rows * seq)
    stored = next((x.dtype for x in jax.tree.leaves(params) if is_array_like(x)), None)
    weights = gradients * itemsize(compute or stored) // itemsize(stored) if stored is not None else 0
    if not attention:
        return TpuTerms(gradients, 0, head, 0, weights)
    layer = attention[0]
    d_model = layer.wo.shape[-1]
    size = itemsize(compute or layer.wo.dtype)
    inputs = 0
    if dims.remat == "full" or isinstance(dims.remat, RematPolicy):
        # Split over the tensor axis under sequence parallelism (along the
        # sequence) and where the stack splits what it keeps (along the features).
        split = t if dims.sequence_parallel or dims.split_saved_inputs else 1
        inputs = analysis.layers * rows * seq * d_model * size // split + named
    heads = max(1, layer.num_heads // t)
    block = min(getattr(layer, "attention_block", seq), seq)
    scores = _SCORE_BLOCKS * rows * heads * seq * block * 4
    hidden = _mlp_hidden(params) // t
    mlp = _HIDDEN_COPIES * rows * seq * hidden * size
    stream = _STREAM_COPIES * rows * seq * d_model * size
    experts = expert_terms(dims, mesh, params, specs)
    layer_bytes = scores + mlp + stream + experts
    return TpuTerms(gradients, inputs, head, layer_bytes, weights)


def spans_slices(mesh: Any, devices_per_slice: int | None) -> bool:
    """Whether a step on `mesh` runs over several slices joined by DCN: its devices
    are TPU devices of more than one slice (`make_mesh(dcn=...)` over a multi-slice
    topology), or `devices_per_slice` (a profile's, as `advise(slices=...)` sets it)
    is fewer than the mesh's devices."""
    if devices_per_slice is not None and mesh.size > devices_per_slice:
        return True
    devices = getattr(mesh, "devices", None)
    return devices is not None and math.prod(slice_factors(np.asarray(devices))) > 1


def extra_wire(
    dims: Any,
    mesh: Any,
    analysis: Analysis,
    params: Any,
    specs: Any,
    manual: frozenset[str],
    *,
    inputs_counted: bool = False,
    sliced: bool = False,
) -> dict[str, dict[tuple[str, ...], int]]:
    """Wire bytes per device, by kind and mesh axes, that the TPU compiler's program
    moves beyond (or, negative, short of) `minimum_comm`'s count (see the module's
    "Collectives beyond the minimum"): the split saved inputs' all-gathers, the
    windowed einsums' extra shards, the head's and the embedding's collectives.
    `manual`: the step's manual axes (a model run manual over its batch axes, as
    an expert-parallel one is, looks its tokens up as the minimum counts);
    `inputs_counted`: the minimum already counts the split saved inputs' gathers;
    `sliced`: the program spans slices (`spans_slices`), where no einsum is
    windowed (the caller counts its reduce-scatters as all-reduces)."""
    extra: dict[str, dict[tuple[str, ...], int]] = {}

    def add(kind: str, axes: tuple[str, ...], w: int) -> None:
        extra.setdefault(kind, {})
        extra[kind][axes] = extra[kind].get(axes, 0) + w

    t = dims.tensor_size
    attention = attention_layers(params)
    rows = max(1, analysis.batch_size // dims.batch_size_multiple)
    seq = (analysis.seq_len or 1) // dims.context_size
    if dims.split_saved_inputs and dims.remat == "full" and t > 1 and attention and not inputs_counted:
        d_model = attention[0].wo.shape[-1]
        size = itemsize(dims.compute_dtype or attention[0].wo.dtype)
        # One gather of each layer's saved input (split along its features) in
        # the recomputed forward: (t - 1) / t of it comes over the wire.
        add("all-gather", (dims.tensor_axis,), analysis.layers * rows * seq * d_model * size * (t - 1) // t)
    # Where eqxpar turns the windowed gradient scatters off (`_tpu_compiler`) they
    # are plain reduce-scatters, as the minimum counts them.
    plain = plain_gradient_scatters(dims, mesh)
    for axes, w in ({} if sliced else _windowed(dims, mesh, params, specs, manual, plain=plain)).items():
        add("collective-permute", axes, w)
    head = _head_weight(params, specs, mesh, dims)
    chunk = getattr(getattr(params, "config", None), "loss_chunk", None)
    if head is not None:
        x, kept, over = head
        g = math.prod(mesh.shape[a] for a in over)
        whole = x.size * itemsize(dims.compute_dtype or x.dtype) // kept
        if chunk is not None and chunk < rows * seq and kept == 1:
            # Vocabulary tiles: each tile is gathered again in the backward (the
            # tile loop is rematerialised) and its gradient all-reduced whole
            # (2 (g - 1) / g of it) where the minimum reduce-scatters it once.
            add("all-gather", over, whole * (g - 1) // g)
            add("all-reduce", over, 2 * whole * (g - 1) // g)
            add("reduce-scatter", over, -(whole * (g - 1) // g))
        elif not manual & set(over) and not sliced and not plain:
            # The head's gradient reduce-scattered as a windowed einsum (`_windowed`).
            add("collective-permute", over, 2 * whole // g)
    if not manual:
        for kind, axes, w in _lookup_wire(dims, mesh, rows * seq, params, specs):
            add(kind, axes, w)
    return extra


def _windowed(
    dims: Any, mesh: Any, params: Any, specs: Any, manual: frozenset[str], *, plain: bool = False
) -> dict[tuple[str, ...], int]:
    """What the layers' windowed einsums move beyond the gathers and scatters the
    minimum counts, per device by batch axes. A windowed einsum over `g` devices
    passes `g + 1` shards of the weight (or of its gradient) round a ring in both
    directions, where an all-gather or reduce-scatter moves `g - 1`: two shards
    more per use. The compiler windows the forward and recomputed forward's
    matmuls of every weight whose product is not summed over `tensor` (a
    row-parallel weight under tensor parallelism is gathered there instead), every
    weight gradient's reduce-scatter, and the input gradient of the MLP's output
    weight (the widest product, `d_hidden`); the other input gradients gather.
    Where the step runs manual over the weight's axes (`manual`; an expert-parallel
    model is) eqxpar gathers it itself: nothing is windowed. With `plain`
    (`_tpu_compiler.plain_gradient_scatters`) the gradients' scatters are not. Read off the compiled programs of Llama-3 8B and 70B on v5p slices under FSDP
    and FSDP x tensor."""
    from ..nn._linear import MLP

    batch = set(dims.batch_axes)
    is_mlp = lambda x: isinstance(x, MLP)  # noqa: E731
    mlps = [x for x in jax.tree.leaves(params, is_leaf=is_mlp) if is_mlp(x)]
    mlp_specs = [x for x in jax.tree.leaves(specs, is_leaf=is_mlp) if is_mlp(x)]
    groups = [
        *(
            (a, s, ("wq", "wk", "wv", "wqkv"), ("wo",))
            for a, s in zip(attention_layers(params), attention_layers(specs), strict=True)
        ),
        *((m, s, ("w_in",), ("w_out",)) for m, s in zip(mlps, mlp_specs, strict=True)),
    ]
    out: dict[tuple[str, ...], int] = {}
    for layer, spec, columns, row_weights in groups:
        for name in (*columns, *row_weights):
            x, s = getattr(layer, name, None), getattr(spec, name, None)
            if x is None or not isinstance(s, PartitionSpec):
                continue
            names = [a for e in s for a in mesh_axis_names(e)]
            over = tuple(a for a in names if a in batch)
            g = math.prod(mesh.shape[a] for a in over)
            if g <= 1 or manual & set(over):
                continue
            kept = math.prod(mesh.shape[a] for a in names if a not in batch)
            whole = x.size * itemsize(dims.compute_dtype or x.dtype) // kept
            summed = name in row_weights and dims.tensor_size > 1 and dims.tensor_axis in names
            uses = (0 if plain else 1) + (0 if summed else 2) + (1 if name == "w_out" else 0)
            out[over] = out.get(over, 0) + uses * 2 * whole // g
    return out


def pipeline_wire(
    dims: Any, mesh: Any, params: Any, specs: Any, loss: Any
) -> dict[str, dict[tuple[str, ...], int]]:
    """What a pipeline step with sharded stage gradients (`Plan(stage_gradients=
    "sharded")`) moves on the TPU compiler beyond (negative: short of) the
    minimum's count, per device by kind and batch axes: the MLP input weight's
    gradient (`[d_model, 2, d_hidden]`, split over the batch axes along its last
    dimension) all-reduced each micro-batch where the minimum reduce-scatters it,
    and the weights outside the stack on the device's own stages only (the
    minimum counts every such weight's gathers and scatters on every device; a
    device runs the embedding on the first stage or the head on the last, and
    the busiest holds the larger)."""
    from ..nn._linear import MLP

    batch = set(dims.batch_axes)
    m = dims.microbatches
    out: dict[str, dict[tuple[str, ...], int]] = {}

    def add(kind: str, axes: tuple[str, ...], w: int) -> None:
        out.setdefault(kind, {})
        out[kind][axes] = out[kind].get(axes, 0) + w

    def split(x: Any, s: Any) -> tuple[int, int, tuple[str, ...]]:
        names = [a for e in s for a in mesh_axis_names(e) if mesh.shape[a] > 1]
        over = tuple(a for a in names if a in batch)
        kept = math.prod(mesh.shape[a] for a in names if a not in batch)
        return (
            x.size * itemsize(dims.compute_dtype or x.dtype) // kept,
            math.prod(mesh.shape[a] for a in over),
            over,
        )

    stack, stack_specs = loss.stack(params), loss.stack(specs)
    is_mlp = lambda x: isinstance(x, MLP)  # noqa: E731
    mlps = [x for x in jax.tree.leaves(stack, is_leaf=is_mlp) if is_mlp(x)]
    mlp_specs = [x for x in jax.tree.leaves(stack_specs, is_leaf=is_mlp) if is_mlp(x)]
    for mlp, spec in zip(mlps, mlp_specs, strict=True):
        if not isinstance(spec.w_in, PartitionSpec) or len(spec.w_in) < mlp.w_in.ndim:
            continue
        whole, g, over = split(mlp.w_in, spec.w_in)
        # Split along its last (hidden) dimension only: split along `d_model`
        # (`rules.FSDP(dim="leading")`) its gradient is reduce-scattered.
        if g > 1 and set(over) & set(mesh_axis_names(spec.w_in[-1])):
            # `whole` is a device's stages' part (the stack is split over `pipe`).
            scatter = m * whole * (g - 1) // g
            add("all-reduce", over, 2 * scatter)
            add("reduce-scatter", over, -scatter)
    # The weights outside the stack, largest first: all but the largest are
    # another stage's (2 gathers and a scatter per micro-batch in the minimum).
    stack_leaves = {id(x) for x in jax.tree.leaves(stack)}
    flat = jax.tree.structure(params).flatten_up_to(specs)
    outside = []
    for x, s in zip(jax.tree.leaves(params), flat, strict=True):
        if id(x) in stack_leaves or not is_array_like(x) or x.ndim != 2 or not isinstance(s, PartitionSpec):
            continue
        whole, g, over = split(x, s)
        if g > 1:
            outside.append((whole, g, over))
    for whole, g, over in sorted(outside, reverse=True)[1:]:
        add("all-gather", over, -2 * m * whole * (g - 1) // g)
        add("reduce-scatter", over, -m * whole * (g - 1) // g)
    return out


def _lookup_wire(
    dims: Any, mesh: Any, tokens: int, params: Any, specs: Any
) -> list[tuple[str, tuple[str, ...], int]]:
    """The embedding's collectives where its lookup runs without gathering the table
    (`eqxpar.nn.Embedding` under FSDP rules, one dimension split over a run of the
    batch axes): per device, less the all-gather and reduce-scatter the minimum
    counts for the table, plus the all-to-all of the table's shard from rows to
    columns (forward) and of its gradient back, the all-to-all of the looked-up
    rows to the batch split and of their cotangent back, and the ids' all-gather
    (int32); `tokens`: a device's positions."""
    from ..nn._vocab import Embedding

    is_embedding = lambda x: isinstance(x, Embedding)  # noqa: E731
    layers = [x for x in jax.tree.leaves(params, is_leaf=is_embedding) if is_embedding(x)]
    layer_specs = [x for x in jax.tree.leaves(specs, is_leaf=is_embedding) if is_embedding(x)]
    batch = tuple(a for a in dims.batch_axes if mesh.shape[a] > 1)
    out = []
    for layer, spec in zip(layers, layer_specs, strict=True):
        s = spec.weight
        if not isinstance(s, PartitionSpec):
            continue
        entries = (*s, None, None)
        vocab, columns = ([a for a in mesh_axis_names(e) if mesh.shape[a] > 1] for e in entries[:2])
        axes = tuple(vocab or columns)
        if (vocab and columns) or not axes or not set(axes) <= set(batch):
            continue
        start = batch.index(axes[0])
        if batch[start : start + len(axes)] != axes:
            continue
        n = math.prod(mesh.shape[a] for a in axes)
        size = itemsize(dims.compute_dtype or layer.weight.dtype)
        table = layer.weight.size * size
        d_model = layer.weight.shape[1]
        counted = table * (n - 1) // n
        out += [("all-gather", axes, -counted), ("reduce-scatter", axes, -counted)]
        moved = 2 * (tokens * d_model * size + (table // n if vocab else 0)) * (n - 1) // n
        out += [("all-to-all", axes, moved), ("all-gather", axes, tokens * 4 * (n - 1))]
    return out


def expert_terms(dims: Any, mesh: Any, params: Any, specs: Any) -> int:
    """One MoE layer's expert weights gathered over the batch axes and their
    gradient whole over them, both in compute dtype, per device: the largest MoE
    layer's (one layer's experts are whole at a time)."""
    # Experts split over the expert axis stay there: only the other batch axes gather.
    batch = set(dims.batch_axes) - {EXPERT_AXIS}
    layer = 0
    for moe, spec in zip(moe_layers(params), moe_layers(specs), strict=True):
        depth = moe.w_in.shape[0] if moe.w_in.ndim == 4 else 1
        one = 0
        for name in ("w_in", "w_gate", "w_out"):
            x, s = getattr(moe, name), getattr(spec, name)
            if x is None or not isinstance(s, PartitionSpec):
                continue
            names = [a for e in s for a in mesh_axis_names(e)]
            kept = math.prod(mesh.shape[a] for a in names if a not in batch)
            one += 2 * x.size // depth // kept * itemsize(dims.compute_dtype or x.dtype)
        layer = max(layer, one)
    return layer


def _mlp_hidden(params: Any) -> int:
    from ..nn._linear import MLP

    is_mlp = lambda x: isinstance(x, MLP)  # noqa: E731
    mlps = [x for x in jax.tree.leaves(params, is_leaf=is_mlp) if is_mlp(x)]
    return max((m.d_hidden for m in mlps), default=0)


def _head_weight(params: Any, specs: Any, mesh: Any, dims: Any) -> tuple[Any, int, tuple[str, ...]] | None:
    """The head: the largest 2-D weight (per device, less its batch axes) split over
    the batch axes; with the product of its other axes' sizes, and its batch axes."""
    batch = set(dims.batch_axes)
    best = None
    flat = jax.tree.structure(params).flatten_up_to(specs)
    for x, spec in zip(jax.tree.leaves(params), flat, strict=True):
        if not is_array_like(x) or x.ndim != 2 or not isinstance(spec, PartitionSpec):
            continue
        names = [mesh_axis_names(e) for e in spec]
        over = tuple(a for n in names for a in n if a in batch)
        if not over:
            continue
        kept = math.prod(mesh.shape[a] for n in names for a in n if a not in batch)
        if best is None or x.size // kept > best[0].size // best[1]:
            best = (x, kept, over)
    return best


def _head(params: Any, specs: Any, mesh: Any, dims: Any, compute: Any, tokens: int) -> int:
    """The head's working set per device for `tokens` positions: the largest 2-D
    weight split over the batch axes (the head) gathered over them and its
    gradient whole, in compute dtype, and its logits in float32 and in compute
    dtype (its longer side is the vocabulary); one tile's where the model's
    `config.loss_chunk` is set and the vocabulary is not split over other axes
    (vocabulary tiles)."""
    best = _head_weight(params, specs, mesh, dims)
    if best is None:
        return 0
    x, kept, _ = best
    size = itemsize(compute if compute is not None else x.dtype)
    vocab = max(x.shape) // kept
    weight = x.size * size // kept
    chunk = getattr(getattr(params, "config", None), "loss_chunk", None)
    tiles = -(-tokens // chunk) if chunk is not None and chunk < tokens and kept == 1 else 1
    return (2 * weight + tokens * vocab * (4 + size)) // tiles
