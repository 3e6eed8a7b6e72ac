"""Vocabulary-parallel embedding, output head and cross-entropy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._collectives import psum_scatter
from .._errors import SpecError
from .._param import param
from ._context import tensor_context
from ._linear import _normal
from ._matmul import check_split, column_matmul


class Embedding(eqx.Module):
    """A token embedding whose vocabulary rows are split over the tensor axis.

    In manual mode each device looks up the ids in its own rows (zeros elsewhere)
    and the partial embeddings are summed over the axis: an all-reduce, or under
    sequence parallelism a reduce-scatter that leaves each device its sequence block.

    **Arguments:** `vocab_size`, `d_model`; keyword-only `axis="tensor"`, `dtype`, `key`.

    Input ids `(batch, seq)`; output `(batch, seq', d_model)`.
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
            return ctx.constrain(jnp.take(self.weight, ids, axis=0), ctx.seq(), None)
        rows = self.weight.shape[0]
        local = ids - jax.lax.axis_index(ctx.axis) * rows
        inside = (local >= 0) & (local < rows)
        found = jnp.take(self.weight, jnp.clip(local, 0, rows - 1), axis=0)
        partial = jnp.where(inside[..., None], found, jnp.zeros((), found.dtype))
        if ctx.sequence_parallel:
            return psum_scatter(partial, axis_name=ctx.axis, axis=1)
        return jax.lax.psum(partial, ctx.axis)


class Unembed(eqx.Module):
    """The output head: `(batch, seq', d_model) -> (batch, seq, vocab)` logits with the
    vocabulary split over the tensor axis (never gathered; feed them to
    `eqxpar.nn.cross_entropy`).

    **Arguments:** `d_model`, `vocab_size`; keyword-only `axis="tensor"`, `dtype`, `key`.
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
