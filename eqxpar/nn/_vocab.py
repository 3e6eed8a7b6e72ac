"""Vocabulary-parallel embedding, output head and cross-entropy."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._collectives import psum_scatter
from .._context_split import context_size
from .._errors import SpecError
from .._mesh import mesh_platform
from .._param import param
from .._plan import current_plan
from .._rules import mesh_axis_names
from .._specs import partition_specs
from .._varying import varying_axes
from ._context import TensorContext, tensor_context
from ._linear import _normal
from ._lookup import automatic_batch_shards, take_rows
from ._matmul import check_split, column_matmul
from ._sequence import check_sequence_splits, split_context, split_sequence, split_tensor_sequence


class Embedding(eqx.Module):
    """A token embedding whose vocabulary rows are split over the tensor axis.

    In manual mode each device looks up the ids in its own rows (zeros elsewhere)
    and the partial embeddings are summed over the axis: an all-reduce, or under
    sequence parallelism a reduce-scatter that leaves each device its sequence block.

    Where the plan's rules leave the logical `"vocab"` axis unsplit (a small
    vocabulary: a rule set without `"vocab"`), the table is whole on every device and
    the lookup needs no collective: under sequence parallelism each device looks up
    only its sequence block of the ids (`vocab_split()` says which case holds).

    **Arguments:** `vocab_size`, `d_model`; keyword-only `axis="tensor"`, `dtype`, `key`.

    Under context parallelism (a `context` mesh axis larger than 1) it looks up
    this device's part of the sequence (`eqxpar.nn.split_sequence`), so the model
    takes the whole sequence of ids.

    Input ids `(batch, seq)`; output `(batch, seq', d_model)`. `attend(h)` reuses the
    same weight as the output head (tied embeddings).

    ```python
    embed = eqxpar.nn.Embedding(50304, 256, key=key)
    h = embed(ids)                          # ids: (batch, seq) int
    logits = embed.attend(h)                # (batch, seq, vocab), vocabulary split
    ```
    """

    weight: Float[Array, "vocab d_model"] = param(axes=("vocab", "embed"))
    vocab_size: int = eqx.field(static=True)
    axis: str = eqx.field(static=True)

    def __init__(
        self, vocab_size: int, d_model: int, *, axis: str = "tensor", dtype=jnp.float32, key: PRNGKeyArray
    ):
        self.weight = (jax.random.normal(key, (vocab_size, d_model)) * 0.02).astype(dtype)
        self.vocab_size, self.axis = vocab_size, axis

    def __call__(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq_out d_model"]:
        ctx = tensor_context(self.axis)
        split = self.vocab_split()
        ids = split_context(ids)
        if not ctx.manual:
            looked_up = _lookup_columns(self, ids, ctx)
            if looked_up is not None:
                return ctx.constrain(looked_up, ctx.seq(), None)
            table = _whole_rows(self.weight, ctx.axis if split else None)
            return ctx.constrain(jnp.take(table, ids, axis=0), ctx.seq(), None)
        if not split:
            # Splitting the ids, not the looked-up rows: the backward pass then sums
            # table-sized gradients over the axis rather than (batch, seq, d_model).
            return take_rows(
                self.weight,
                split_tensor_sequence(ids, axis=self.axis),
                batch_shards=automatic_batch_shards(ctx.batch_axes),
            )
        rows = self.weight.shape[0]
        local = ids - jax.lax.axis_index(ctx.axis) * rows
        inside = (local >= 0) & (local < rows)
        found = take_rows(
            self.weight, jnp.clip(local, 0, rows - 1), batch_shards=automatic_batch_shards(ctx.batch_axes)
        )
        partial = jnp.where(inside[..., None], found, jnp.zeros((), found.dtype))
        if ctx.sequence_parallel:
            check_sequence_splits(ids.shape[1], ctx, "Embedding")
            return psum_scatter(partial, axis_name=ctx.axis, axis=1)
        return jax.lax.psum(partial, ctx.axis)

    def attend(self, x: Float[Array, "batch seq_in d_model"]) -> Float[Array, "batch seq vocab"]:
        """The output head of tied embeddings: logits `x @ weight.T`, scored against
        this embedding's own rows.

        The rows are split over the tensor axis, so this is a column-parallel matmul
        with the vocabulary as output features: each device scores its own rows and
        the logits stay split over the vocabulary (never gathered; feed them to
        `eqxpar.nn.cross_entropy` with `head=` this embedding). Under sequence parallelism in manual mode the
        input is this device's sequence block and is gathered first (or around a
        ring with `tp_overlap`), like `Unembed`'s. The weight's gradient collects
        both uses, lookup and head.

        **Arguments:** `x`: `(batch, seq', d_model)` activations.

        **Returns:** logits `(batch, seq, vocab)`, vocabulary split over the axis
        (`vocab / n` columns per device in manual mode).

        ```python
        logits = model.embed.attend(model.norm(h))
        loss = eqxpar.nn.cross_entropy(logits, labels, head=model.embed).mean()
        ```
        """
        return _unembed(x, self.weight.T, self.vocab_split(), tensor_context(self.axis))

    def vocab_split(self) -> bool:
        """Whether the vocabulary is split over the tensor axis where this is traced:
        in manual mode, whether the weight is this device's shard of the rows; in
        automatic mode, whether the active plan's rules split its `"vocab"` axis."""
        return _vocab_split(self, 0, self.weight.shape[0], "Embedding.weight (vocab_size)")


def _vocab_split(layer: eqx.Module, dim: int, rows: int, what: str) -> bool:
    ctx = tensor_context(layer.axis)
    whole = rows == layer.vocab_size
    if not (ctx.manual and whole):
        # A whole table inside the manual region is the rules' choice, not a mistake.
        check_split(rows, layer.vocab_size, ctx, what=what)
    if ctx.manual:
        # Over one device "split" and "whole" are the same table: keep the split
        # path, whose reductions mark the result the same on every device.
        return not whole or ctx.size == 1
    plan = current_plan()
    if plan is None:
        return False
    spec = partition_specs(layer, plan).weight
    return dim < len(spec) and ctx.axis in mesh_axis_names(spec[dim])


def _unembed(x: Array, weight: Array, split: bool, ctx: TensorContext) -> Array:
    if split:
        (logits,) = column_matmul(x, [weight], ctx)
        return logits
    # The whole vocabulary on every device: no gather, even of a sequence block
    # (the logits stay this device's block; `cross_entropy` splits the labels).
    return ctx.constrain(jnp.tensordot(x, weight, axes=1), ctx.seq(), None)


def _whole_rows(weight: Array, axis: str | None) -> Array:
    # Automatic mode: a lookup reads whole rows, so give GSPMD the table split over
    # the vocabulary only. Under FSDP rules its model dimension is split too, and
    # GSPMD would otherwise have to move the looked-up rows from a feature split to
    # the batch split (an all-to-all it does not do: it rematerialises the whole
    # activation, and says so). Gathering a weight for use is what FSDP does anyway.
    plan = current_plan()
    if (
        plan is None
        or not isinstance(weight, jax.core.Tracer)
        or jax.sharding.get_abstract_mesh().manual_axes
    ):
        return weight
    return jax.lax.with_sharding_constraint(weight, NamedSharding(plan.mesh, PartitionSpec(axis, None)))


def _lookup_columns(layer: Embedding, ids: Array, ctx: TensorContext) -> Array | None:
    """Automatic mode, a table split over batch axes only (FSDP rules), on its model
    dimension or its vocabulary: look the rows up without gathering the table, as
    MaxText does. None where that does not apply (the caller gathers whole rows).

    In a region manual over those axes only (the others stay automatic), each device
    gathers its group's ids (int32, tokens only), reads its own columns of every
    token's row, and one all-to-all turns the feature split into the batch split the
    activations have. A table split on its vocabulary (`rules.FSDP()` splits the
    largest dimension) is first turned into column shards by an all-to-all of the
    table (a shard's worth of wire, not the whole table's). The gradient is then each
    device's scatter-add into its own columns (and the all-to-all back to its rows):
    no whole table is gathered for the lookup, no whole-table gradient exists, and
    there is no whole-table all-reduce over the batch axes. GSPMD does none of this
    itself: given a table split on its columns it rematerialises the looked-up
    activations rather than move them (see _whole_rows). The values are those of
    `jnp.take` on the whole table: a lookup is a copy.
    """
    plan = current_plan()
    weight = layer.weight
    if (
        plan is None
        or not isinstance(weight, jax.core.Tracer)
        or jax.sharding.get_abstract_mesh().manual_axes
    ):
        return None
    if ids.ndim < 2:
        return None
    mesh = plan.mesh
    spec = tuple(partition_specs(layer, plan).weight) + (None, None)

    def split(entry: object) -> tuple[str, ...]:
        return tuple(a for a in mesh_axis_names(entry) if mesh.shape[a] > 1)

    vocab, columns = split(spec[0]), split(spec[1])
    batch = tuple(a for a in ctx.batch_axes if mesh.shape[a] > 1)
    axes = vocab or columns
    # One of the two dimensions split, over batch axes only: a vocabulary split over
    # the tensor axis is vocabulary parallelism, which has its own path.
    if (vocab and columns) or not axes or not set(axes) <= set(batch):
        return None
    # The table's axes must be a run of the batch axes, in the same order: then the
    # devices of one group hold consecutive blocks of the batch, and gathering the
    # ids over them (and the all-to-all back) keeps the batch's own layout.
    start = batch.index(axes[0])
    if batch[start : start + len(axes)] != axes:
        return None
    before, after = batch[:start], batch[start + len(axes) :]
    groups = math.prod(mesh.shape[a] for a in before)
    n = math.prod(mesh.shape[a] for a in axes)
    rows = ids.shape[0]
    if weight.shape[1] % n or rows % (groups * n * math.prod(mesh.shape[a] for a in after)):
        return None
    # (batch, ...) as (groups before the table's axes, group member, rows of each):
    # one dimension per part of the batch's split, the region manual over the middle one.
    grouped = ids.reshape(groups, n, rows // (groups * n), *ids.shape[1:])
    grouped = jax.lax.with_sharding_constraint(
        grouped,
        NamedSharding(mesh, PartitionSpec(before or None, axes, after or None, *([None] * (ids.ndim - 1)))),
    )

    def local(table: Array, ids: Array) -> Array:
        if vocab:
            table = jax.lax.all_to_all(table, axes, split_axis=1, concat_axis=0, tiled=True)
        ids = jax.lax.all_gather(ids, axes, axis=1, tiled=True)
        found = jnp.take(table, ids, axis=0)
        return jax.lax.all_to_all(found, axes, split_axis=1, concat_axis=found.ndim - 1, tiled=True)

    # Manual over the other batch axes too (the table is whole over them): left
    # automatic, the partitioner gathered the looked-up rows over them inside the
    # region (over `data`, across slices in HSDP) and sliced them again after.
    rows_spec = PartitionSpec(before or None, axes, after or None)
    # The table is whole over those axes, so the region's transpose sums its
    # gradient over them: XLA:CPU aborts compiling that sum in bfloat16 in a
    # partial-manual region (`_collectives.wire_dtype`), so there the table enters
    # in float32 (a lookup is a copy: the same values either way).
    dtype = weight.dtype
    # The mesh's platform, not the default backend's: a program compiled here for a
    # TPU topology keeps its bfloat16 sum.
    if (before or after) and dtype == jnp.bfloat16 and mesh_platform(mesh) == "cpu":
        weight = weight.astype(jnp.float32)
    found = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(axes, None) if vocab else PartitionSpec(None, axes), rows_spec),
        out_specs=rows_spec,
        axis_names=set(before) | set(axes) | set(after),
    )(weight, grouped)
    return found.astype(dtype).reshape(*ids.shape, weight.shape[1])


class Unembed(eqx.Module):
    """The output head: `(batch, seq', d_model) -> (batch, seq, vocab)` logits with the
    vocabulary split over the tensor axis (never gathered; feed them to
    `eqxpar.nn.cross_entropy` with `head=` this layer, which tells it the split). Where the plan's rules keep `"vocab"` whole, each
    device computes all the logits of its own tokens: no collective, and under
    sequence parallelism the logits are this device's sequence block.

    **Arguments:** `d_model`, `vocab_size`; keyword-only `axis="tensor"`, `dtype`, `key`.
    For an output head that shares the input embedding's weight, use
    `Embedding.attend` instead.

    ```python
    head = eqxpar.nn.Unembed(256, 50304, key=key)
    loss = eqxpar.nn.cross_entropy(head(h), labels, head=head).mean()
    ```
    """

    weight: Float[Array, "d_model vocab"] = param(axes=("embed", "vocab"))
    vocab_size: int = eqx.field(static=True)
    axis: str = eqx.field(static=True)

    def __init__(
        self, d_model: int, vocab_size: int, *, axis: str = "tensor", dtype=jnp.float32, key: PRNGKeyArray
    ):
        self.weight = _normal(key, (d_model, vocab_size), d_model, dtype)
        self.vocab_size, self.axis = vocab_size, axis

    def __call__(self, x: Float[Array, "batch seq_in d_model"]) -> Float[Array, "batch seq vocab"]:
        return _unembed(x, self.weight, self.vocab_split(), tensor_context(self.axis))

    def vocab_split(self) -> bool:
        """As `Embedding.vocab_split`: whether the logits' vocabulary is split here."""
        return _vocab_split(self, 1, self.weight.shape[1], "Unembed.weight (vocab_size)")


def cross_entropy(
    logits: Float[Array, "batch seq vocab"],
    labels: Int[Array, "_batch _seq"],
    *,
    head: "Unembed | Embedding | None" = None,
    vocab_split: bool | None = None,
    axis: str | None = None,
) -> Float[Array, "batch seq"]:
    """Per-token softmax cross-entropy of an output head's logits, in float32,
    without gathering a vocabulary split over the tensor axis.

    Whether the logits are one device's vocabulary shard or the whole vocabulary
    depends on the plan's rules, and the loss must know it: read as a shard, whole
    logits lose `log(n)` per token. The head knows, so pass it: `head=` the layer
    that produced the logits (an `Unembed`, or the `Embedding` whose `attend` did),
    whose `vocab_split()` is read here. `vocab_split=` gives the answer directly.
    Without either, the answer is derived where it cannot be wrong (automatic mode,
    one device, a manual tensor axis of size 1) and a manual tensor axis of size
    n > 1 raises `eqxpar.SpecError`.

    Vocabulary split, in manual mode: each device holds `vocab / n` logits per
    token; the maximum, the sum of exponentials and the target's logit are each
    reduced over the axis as one number per token, so the traffic is O(batch x
    seq), not O(batch x seq x vocab). In automatic mode it is optax's
    cross-entropy on logits constrained to the split.

    Whole vocabulary (the plan's rules keep `"vocab"` unsplit): no collective.
    Under sequence parallelism in manual mode the logits are this device's
    sequence block and the labels are split to match (reduce the result with
    `eqxpar.nn.sequence_mean`, which is right in every layout).

    Under context parallelism the logits hold this device's part of the sequence;
    `labels` may be the whole sequence, which is split to match
    (`eqxpar.nn.split_sequence`), or already split.

    Whatever the logits' dtype (bfloat16 under `Plan(compute_dtype=...)`), the
    log-softmax, the target logit and the reductions over the axis run in float32
    (float64 logits stay float64), as does the returned loss; the head's matmul
    keeps the compute dtype.

    **Arguments:** `logits` `(batch, seq, vocab or vocab / n)` (or `(batch, seq / n,
    vocab)`, see above), integer `labels` `(batch, seq)`; keyword-only `head`
    (the layer whose output `logits` are), `vocab_split` (bool: the head's
    `vocab_split()`), and `axis` (the mesh axis; default the head's, else
    `"tensor"`).

    **Returns:** the float32 loss of every token, `(batch, seq)` (`(batch, seq / n)`
    for a sequence block).

    **Raises:** `eqxpar.SpecError` in a manual region whose tensor axis has more
    than one device when neither `head` nor `vocab_split` is given; when
    `vocab_split` or `axis` contradicts `head`, or the logits' vocabulary width is
    not what `head` produces here; when logits and labels disagree in (batch, seq).

    ```python
    loss = eqxpar.nn.cross_entropy(model.head(h), targets, head=model.head).mean()
    ```
    """
    axis, split = _resolve_split(logits, head, vocab_split, axis)
    ctx = tensor_context(axis)
    # At least float32 whatever the compute dtype: a bfloat16 log-softmax and mean
    # round the loss to 8 bits, differently for every plan's summation order.
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    # Whole label sequences are split as the logits' sequence was: over `context`,
    # then (a whole-vocabulary head under sequence parallelism) over the tensor axis.
    blocks = ctx.size if not split and ctx.manual and ctx.sequence_parallel else 1
    if context_size() * blocks > 1 and labels.shape[1:] == (logits.shape[1] * context_size() * blocks,):
        labels = split_sequence(labels, axis=axis) if blocks > 1 else split_context(labels)
    if logits.shape[:-1] != labels.shape:
        raise SpecError(
            f"cross_entropy: logits of shape {logits.shape} do not match labels of shape {labels.shape} "
            "in (batch, seq). Under sequence parallelism the output head gathers the sequence: pass "
            "the head's logits, not a sequence-split activation, and the whole label sequence."
        )
    if not split:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if not ctx.manual:
        return optax.softmax_cross_entropy_with_integer_labels(ctx.constrain(logits, None, ctx.axis), labels)
    if ctx.size > 1 and ctx.axis not in varying_axes(logits) and varying_axes(labels):
        # JAX tracks what varies here (the labels do), and the logits are the same on
        # every device of the axis: the whole vocabulary, not a shard. Summing their
        # exponentials over the axis would add log(n) to every token's loss.
        raise SpecError(
            f"cross_entropy: the logits {logits.shape} are the same on every device of the manual "
            f"axis {ctx.axis!r} (size {ctx.size}), so they hold the whole vocabulary, but "
            "vocab_split=True reads them as one device's shard. Pass the layer that produced them, "
            "head=<the Unembed, or the Embedding whose attend did> (its vocab_split() is False where "
            'the plan\'s rules keep "vocab" whole), and average a whole-vocabulary loss under '
            "sequence parallelism with eqxpar.nn.sequence_mean, as eqxpar.models.lm_loss does."
        )
    columns = logits.shape[-1]
    # The max only stabilises the exponentials; it cancels in the loss, so it
    # needs no gradient (and pmax has no transpose).
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), ctx.axis)
    shifted = logits - top[..., None]
    total = jax.lax.psum(jnp.sum(jnp.exp(shifted), axis=-1), ctx.axis)
    local = labels - jax.lax.axis_index(ctx.axis) * columns
    inside = (local >= 0) & (local < columns)
    picked = jnp.take_along_axis(shifted, jnp.clip(local, 0, columns - 1)[..., None], axis=-1)[..., 0]
    target = jax.lax.psum(jnp.where(inside, picked, jnp.zeros((), picked.dtype)), ctx.axis)
    return jnp.log(total) - target


def _resolve_split(
    logits: Array, head: "Unembed | Embedding | None", vocab_split: bool | None, axis: str | None
) -> tuple[str, bool]:
    """`cross_entropy`'s mesh axis and whether its logits are a vocabulary shard:
    the head's answer, the caller's, or (neither given) the one every layout agrees
    on; never a default that a layout can make wrong."""
    if head is not None:
        if not callable(getattr(head, "vocab_split", None)) or not hasattr(head, "vocab_size"):
            raise SpecError(
                f"cross_entropy(head={type(head).__name__}): expected the layer that produced the "
                "logits, an eqxpar.nn.Unembed or the eqxpar.nn.Embedding whose attend did (it "
                "says whether its vocabulary is split). For another head pass vocab_split=<bool>."
            )
        if axis is not None and axis != head.axis:
            raise SpecError(
                f"cross_entropy: axis={axis!r}, but the head {type(head).__name__} splits its "
                f"vocabulary over {head.axis!r}. Drop axis=; the head's axis is used."
            )
        split = head.vocab_split()
        if vocab_split is not None and vocab_split != split:
            raise SpecError(
                f"cross_entropy: vocab_split={vocab_split}, but the head {type(head).__name__} says "
                f"its logits are {'a vocabulary shard' if split else 'the whole vocabulary'} here "
                f"(vocab_split()={split}). Drop vocab_split=; the head's answer is used."
            )
        ctx = tensor_context(head.axis)
        expected = head.vocab_size // ctx.size if split and ctx.manual else head.vocab_size
        if logits.shape[-1] != expected:
            raise SpecError(
                f"cross_entropy: the logits have {logits.shape[-1]} vocabulary columns, but the head "
                f"{type(head).__name__} (vocab_size {head.vocab_size}) produces {expected} here "
                f"({'split' if split else 'whole'} over {head.axis!r}). Pass the logits this head "
                "returned, with head= that head."
            )
        return head.axis, split
    axis = "tensor" if axis is None else axis
    if vocab_split is not None:
        return axis, bool(vocab_split)
    ctx = tensor_context(axis)
    if ctx.manual and ctx.size > 1:
        raise SpecError(
            f"cross_entropy: mesh axis {axis!r} is manual here with {ctx.size} devices, so the logits "
            f"{logits.shape} may be one device's vocabulary shard or the whole vocabulary (the plan's "
            f"rules decide), and the two readings differ by log({ctx.size}) per token. Pass the layer "
            "that produced them: cross_entropy(logits, labels, head=model.head) (an Unembed, or the "
            "Embedding whose attend did), or vocab_split=head.vocab_split()."
        )
    # Automatic mode: optax's loss is right whatever the logits' sharding. A manual
    # axis of one device: "split" and "whole" are the same vocabulary, and the split
    # path marks the result the same on every device.
    return axis, ctx.manual
