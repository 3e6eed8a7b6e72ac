"""Vocabulary-parallel embedding, output head and cross-entropy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._collectives import psum_scatter
from .._errors import SpecError
from .._param import param
from .._plan import current_plan
from ._context import TensorContext, tensor_context
from ._linear import _normal
from ._matmul import check_split, column_matmul


class Embedding(eqx.Module):
    """A token embedding whose vocabulary rows are split over the tensor axis.

    In manual mode each device looks up the ids in its own rows (zeros elsewhere)
    and the partial embeddings are summed over the axis: an all-reduce, or under
    sequence parallelism a reduce-scatter that leaves each device its sequence block.

    **Arguments:** `vocab_size`, `d_model`; keyword-only `axis="tensor"`, `dtype`, `key`.

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
        check_split(self.weight.shape[0], self.vocab_size, ctx, what="Embedding.weight (vocab_size)")
        if not ctx.manual:
            return ctx.constrain(jnp.take(_whole_rows(self.weight, ctx), ids, axis=0), ctx.seq(), None)
        rows = self.weight.shape[0]
        local = ids - jax.lax.axis_index(ctx.axis) * rows
        inside = (local >= 0) & (local < rows)
        found = jnp.take(self.weight, jnp.clip(local, 0, rows - 1), axis=0)
        partial = jnp.where(inside[..., None], found, jnp.zeros((), found.dtype))
        if ctx.sequence_parallel:
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
        ctx = tensor_context(self.axis)
        check_split(self.weight.shape[0], self.vocab_size, ctx, what="Embedding.weight (vocab_size)")
        (logits,) = column_matmul(x, [self.weight.T], ctx)
        return logits


def _whole_rows(weight: Array, ctx: TensorContext) -> Array:
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
    return jax.lax.with_sharding_constraint(weight, NamedSharding(plan.mesh, PartitionSpec(ctx.axis, None)))


class Unembed(eqx.Module):
    """The output head: `(batch, seq', d_model) -> (batch, seq, vocab)` logits with the
    vocabulary split over the tensor axis (never gathered; feed them to
    `eqxpar.nn.cross_entropy`).

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
        ctx = tensor_context(self.axis)
        check_split(self.weight.shape[1], self.vocab_size, ctx, what="Unembed.weight (vocab_size)")
        (logits,) = column_matmul(x, [self.weight], ctx)
        return logits


def cross_entropy(
    logits: Float[Array, "batch seq vocab"], labels: Int[Array, "_batch _seq"], *, axis: str = "tensor"
) -> Float[Array, "batch seq"]:
    """Per-token softmax cross-entropy of vocabulary-split logits, without gathering them.

    In manual mode each device holds `vocab / n` logits per token: the maximum,
    the sum of exponentials and the target's logit are each reduced over the axis as
    one number per token, so the traffic is O(batch x seq), not O(batch x seq x
    vocab). In automatic mode it is optax's cross-entropy on constrained logits.

    **Arguments:** `logits` `(batch, seq, vocab or vocab / n)`, integer `labels`
    `(batch, seq)`, keyword-only `axis`.

    **Returns:** the loss of every token, `(batch, seq)`.

    ```python
    loss = eqxpar.nn.cross_entropy(head(h), targets).mean()
    ```
    """
    if logits.shape[:-1] != labels.shape:
        raise SpecError(
            f"cross_entropy: logits of shape {logits.shape} do not match labels of shape {labels.shape} "
            "in (batch, seq). Under sequence parallelism the output head gathers the sequence: pass "
            "the head's logits, not a sequence-split activation, and the whole label sequence."
        )
    ctx = tensor_context(axis)
    if not ctx.manual:
        return optax.softmax_cross_entropy_with_integer_labels(ctx.constrain(logits, None, ctx.axis), labels)
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
