"""Vocabulary-parallel embedding, output head and cross-entropy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._collectives import psum_scatter
from .._context_split import context_size
from .._errors import SpecError
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
        `eqxpar.nn.cross_entropy`). Under sequence parallelism in manual mode the
        input is this device's sequence block and is gathered first (or around a
        ring with `tp_overlap`), like `Unembed`'s. The weight's gradient collects
        both uses, lookup and head.

        **Arguments:** `x`: `(batch, seq', d_model)` activations.

        **Returns:** logits `(batch, seq, vocab)`, vocabulary split over the axis
        (`vocab / n` columns per device in manual mode).

        ```python
        logits = model.embed.attend(model.norm(h))
        loss = eqxpar.nn.cross_entropy(logits, labels).mean()
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


class Unembed(eqx.Module):
    """The output head: `(batch, seq', d_model) -> (batch, seq, vocab)` logits with the
    vocabulary split over the tensor axis (never gathered; feed them to
    `eqxpar.nn.cross_entropy`). Where the plan's rules keep `"vocab"` whole, each
    device computes all the logits of its own tokens: no collective, and under
    sequence parallelism the logits are this device's sequence block.

    **Arguments:** `d_model`, `vocab_size`; keyword-only `axis="tensor"`, `dtype`, `key`.
    For an output head that shares the input embedding's weight, use
    `Embedding.attend` instead.

    ```python
    head = eqxpar.nn.Unembed(256, 50304, key=key)
    loss = eqxpar.nn.cross_entropy(head(h), labels).mean()
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
    axis: str = "tensor",
    vocab_split: bool = True,
) -> Float[Array, "batch seq"]:
    """Per-token softmax cross-entropy of vocabulary-split logits, without gathering them.

    In manual mode each device holds `vocab / n` logits per token: the maximum,
    the sum of exponentials and the target's logit are each reduced over the axis as
    one number per token, so the traffic is O(batch x seq), not O(batch x seq x
    vocab). In automatic mode it is optax's cross-entropy on constrained logits.

    With `vocab_split=False` (the head's `vocab_split()` is False: the plan's rules
    keep the vocabulary whole) the logits hold every column and no collective is
    issued; under sequence parallelism in manual mode they are this device's sequence
    block, and the labels are split to match (reduce the result with
    `eqxpar.nn.sequence_mean`).

    Under context parallelism the logits hold this device's part of the sequence;
    `labels` may be the whole sequence, which is split to match
    (`eqxpar.nn.split_sequence`), or already split.

    **Arguments:** `logits` `(batch, seq, vocab or vocab / n)` (or `(batch, seq / n,
    vocab)`, see above), integer `labels` `(batch, seq)`, keyword-only `axis` and
    `vocab_split`.

    **Returns:** the loss of every token, `(batch, seq)` (`(batch, seq / n)` for a
    sequence block).

    ```python
    loss = eqxpar.nn.cross_entropy(head(h), targets).mean()
    ```
    """
    ctx = tensor_context(axis)
    # Whole label sequences are split as the logits' sequence was: over `context`,
    # then (a whole-vocabulary head under sequence parallelism) over the tensor axis.
    blocks = ctx.size if not vocab_split and ctx.manual and ctx.sequence_parallel else 1
    if context_size() * blocks > 1 and labels.shape[1:] == (logits.shape[1] * context_size() * blocks,):
        labels = split_sequence(labels, axis=axis) if blocks > 1 else split_context(labels)
    if logits.shape[:-1] != labels.shape:
        raise SpecError(
            f"cross_entropy: logits of shape {logits.shape} do not match labels of shape {labels.shape} "
            "in (batch, seq). Under sequence parallelism the output head gathers the sequence: pass "
            "the head's logits, not a sequence-split activation, and the whole label sequence."
        )
    if not vocab_split:
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
            "vocab_split=True reads them as one device's shard. Pass the head's own answer, "
            'vocab_split=head.vocab_split() (False where the plan\'s rules keep "vocab" whole), '
            "and average a whole-vocabulary loss under sequence parallelism with "
            "eqxpar.nn.sequence_mean, as eqxpar.models.lm_loss does."
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
