"""Low-rank adapters (LoRA) on the projections of `Attention` and `MLP`.

An adapter adds `scale * (x @ a) @ b` to its projection's output, `a`
`(*in, rank)` and `b` `(rank, *out)` in the base weight's orientation. Its
weights declare the logical axes of the base weight's dimensions they share, the
rank dimension none, so a plan's rules place them with their base: for a
column-parallel projection (Q, K, V, gate, up) `a` is whole over the tensor axis
and `b` split like the base's output; for a row-parallel one (the attention
output, down) `a` is split like the base's input and `b` whole.

Dropout (`dropout > 0` and a key): each adapter's input is dropped with a mask
of its own, as PEFT's `lora_dropout`. In automatic mode it masks the whole
input (threefry is partitionable: one device's masks for one key); in manual mode
each device masks the part it holds, with the key the step gives it (its own
under a sequence split; a row-parallel adapter folds in its tensor index, its
input's features being split), so a column-parallel adapter's `x @ a` then needs
its own gather of `x` under sequence parallelism, not the base weights'.

Communication: in manual mode a column-parallel adapter's `x @ a` uses the base
weights' gather of `x` under sequence parallelism (their ring under
`tp_overlap`) and the same sum of its cotangent; a row-parallel adapter sums its
`(batch, seq, rank)` partial product over the tensor axis (the adapter's own
collective, `rank / d_model` of the base output's). In automatic mode the
adapters a product needs whole are gathered first, as FSDP gathers a weight.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from .._collectives import all_gather
from .._param import param
from .._plan import current_plan
from ._context import TensorContext
from ._dropout import Dropout
from ._matmul import column_matmul, row_matmul

#: The logical projections an adapter can sit on, per layer.
ATTENTION_TARGETS = ("q", "k", "v", "qkv", "o")
MLP_TARGETS = ("gate", "up", "down")


class AttentionLoRA(eqx.Module):
    """The low-rank adapters of one `eqxpar.nn.Attention` (`attention.lora`):
    one pair `(X_a, X_b)` per adapted projection, None for the others.

    `q_a` `(d_model, rank)`, `q_b` `(rank, heads, head_dim)`; `k_*`, `v_*` with
    `kv_heads`; `qkv_a`, `qkv_b` `(rank, 3, heads, head_dim)` on a fused QKV
    weight; `o_a` `(heads, head_dim, rank)`, `o_b` `(rank, d_model)`. The
    projection's output gains `alpha / rank * (drop(x) @ X_a) @ X_b`, `drop`
    dropout at rate `dropout` (PEFT's `lora_dropout`; each adapter its own mask)
    when the layer's call gets a `key`, else the identity. Built by
    `eqxpar.models.add_lora`; `rank`, `alpha`, `dropout` static.

    ```python
    model = eqxpar.models.add_lora(model, rank=8, alpha=16, targets=("q", "v"), key=key)
    model.blocks.blocks.attn.lora.q_a.shape     # (layers, d_model, 8)
    ```
    """

    q_a: Float[Array, "*layers d_model rank"] | None = param(axes=("embed", None), default=None)
    q_b: Float[Array, "*layers rank heads head_dim"] | None = param(axes=(None, "heads", None), default=None)
    k_a: Float[Array, "*layers d_model rank"] | None = param(axes=("embed", None), default=None)
    k_b: Float[Array, "*layers rank kv_heads head_dim"] | None = param(
        axes=(None, "kv_heads", None), default=None
    )
    v_a: Float[Array, "*layers d_model rank"] | None = param(axes=("embed", None), default=None)
    v_b: Float[Array, "*layers rank kv_heads head_dim"] | None = param(
        axes=(None, "kv_heads", None), default=None
    )
    qkv_a: Float[Array, "*layers d_model rank"] | None = param(axes=("embed", None), default=None)
    qkv_b: Float[Array, "*layers rank three heads head_dim"] | None = param(
        axes=(None, None, "heads", None), default=None
    )
    o_a: Float[Array, "*layers heads head_dim rank"] | None = param(axes=("heads", None, None), default=None)
    o_b: Float[Array, "*layers rank d_model"] | None = param(axes=(None, "embed"), default=None)
    rank: int = eqx.field(static=True, default=8)
    alpha: float = eqx.field(static=True, default=8.0)
    dropout: float = eqx.field(static=True, default=0.0)

    @property
    def scale(self) -> float:
        """`alpha / rank`, what the adapters' products are multiplied by."""
        return self.alpha / self.rank


class MLPLoRA(eqx.Module):
    """The low-rank adapters of one `eqxpar.nn.MLP` (`mlp.lora`): `gate_a`, `up_a`
    `(d_model, rank)` and `gate_b`, `up_b` `(rank, d_hidden)` on the two halves
    of the stacked input weight (`up` is a GELU MLP's only input projection);
    `down_a` `(d_hidden, rank)`, `down_b` `(rank, d_model)` on the output. As
    `AttentionLoRA` otherwise.

    ```python
    model = eqxpar.models.add_lora(model, rank=8, alpha=16, targets=("gate", "up", "down"), key=key)
    ```
    """

    gate_a: Float[Array, "*layers d_model rank"] | None = param(axes=("embed", None), default=None)
    gate_b: Float[Array, "*layers rank d_hidden"] | None = param(axes=(None, "mlp"), default=None)
    up_a: Float[Array, "*layers d_model rank"] | None = param(axes=("embed", None), default=None)
    up_b: Float[Array, "*layers rank d_hidden"] | None = param(axes=(None, "mlp"), default=None)
    down_a: Float[Array, "*layers d_hidden rank"] | None = param(axes=("mlp", None), default=None)
    down_b: Float[Array, "*layers rank d_model"] | None = param(axes=(None, "embed"), default=None)
    rank: int = eqx.field(static=True, default=8)
    alpha: float = eqx.field(static=True, default=8.0)
    dropout: float = eqx.field(static=True, default=0.0)

    @property
    def scale(self) -> float:
        """`alpha / rank`, what the adapters' products are multiplied by."""
        return self.alpha / self.rank


def lora_dropout(layer: object) -> float:
    """The dropout rate of `layer`'s adapters (0 without adapters)."""
    lora = getattr(layer, "lora", None)
    return 0.0 if lora is None else lora.dropout


def adapter_pairs(lora: AttentionLoRA | MLPLoRA, names: tuple[str, ...]) -> list[tuple[str, Array, Array]]:
    """`(name, a, b)` of each of `names` that `lora` adapts, in order."""
    out = []
    for name in names:
        a = getattr(lora, f"{name}_a")
        if a is not None:
            out.append((name, a, getattr(lora, f"{name}_b")))
    return out


def column_with_adapters(
    x: Array,
    weights: list[Array],
    pairs: list,
    scale: float,
    ctx: TensorContext,
    *,
    split_dim: int,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> tuple[list[Array], list[Array]]:
    """`column_matmul(x, weights)` and each adapter's `scale * (drop(x) @ a) @ b`
    (`pairs`: `(name, a, b)`), split over the tensor axis like its base's output;
    `drop` dropout at rate `dropout` with a mask per adapter when `key` is given.

    In manual mode the `a`s join the base weights' product: one gather (or ring)
    of `x` under sequence parallelism, one sum of its cotangent over the axis.
    """
    if not pairs:
        return column_matmul(x, weights, ctx, split_dim=split_dim), []
    n = len(weights)
    if dropout > 0 and key is not None:
        # Each adapter's input a dropout of its own: no product shared with the base.
        ys = column_matmul(x, weights, ctx, split_dim=split_dim)
        us = []
        for (_, a, _), k in zip(pairs, jax.random.split(key, len(pairs)), strict=True):
            dropped = Dropout(dropout)(x, key=k)
            if ctx.manual:
                us.extend(column_matmul(dropped, [a], ctx))
            else:
                whole = ctx.constrain(dropped, ctx.seq(), None)
                us.append(ctx.constrain(jnp.tensordot(whole, _gathered(a), axes=1), None, None))
    elif ctx.manual and ctx.sequence_parallel and not ctx.overlap:
        # One gather of x for base and adapters, but products apart: in one joined
        # product the adapters' gradient would compute the frozen base weights' too.
        whole = all_gather(x, axis_name=ctx.axis, axis=1)
        ys = [jnp.tensordot(whole, w, axes=1) for w in weights]
        us = [jnp.tensordot(whole, a, axes=1) for _, a, _ in pairs]
    elif ctx.manual:
        # Without sequence parallelism each product is apart already; with tp_overlap
        # the adapters join the ring's product (one ring of x), at the cost above.
        outs = column_matmul(x, [*weights, *(a for _, a, _ in pairs)], ctx, split_dim=split_dim)
        ys, us = outs[:n], outs[n:]
    else:
        ys = column_matmul(x, weights, ctx, split_dim=split_dim)
        whole = ctx.constrain(x, ctx.seq(), None)
        # The rank dimension is never split: the adapter's inputs are whole.
        us = [ctx.constrain(jnp.tensordot(whole, _gathered(a), axes=1), None, None) for _, a, _ in pairs]
    deltas = []
    for (_, _, b), u in zip(pairs, us, strict=True):
        delta = jnp.tensordot(u, b, axes=1) * jnp.asarray(scale, u.dtype)
        entries: list[str | None] = [None] * b.ndim  # delta's seq, then b's output dims
        entries[split_dim % b.ndim] = ctx.axis
        deltas.append(ctx.constrain(delta, *entries))
    return ys, deltas


def row_adapter(
    h: Array,
    a: Array,
    b: Array,
    scale: float,
    ctx: TensorContext,
    *,
    in_dims: int,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> Array:
    """`scale * (drop(h) @ a) @ b` of a row-parallel projection: `h @ a` is summed
    over the tensor axis (split along the sequence under sequence parallelism)
    like the base's output, then multiplied by the whole `b`; `drop` dropout at
    rate `dropout` when `key` is given."""
    if dropout > 0 and key is not None:
        if ctx.manual:
            # This device holds some of h's features: a mask of their own.
            key = jax.random.fold_in(key, jax.lax.axis_index(ctx.axis))
        h = Dropout(dropout)(h, key=key)
    u = row_matmul(h, a, ctx, in_dims=in_dims)
    return jnp.tensordot(u, b if ctx.manual else _gathered(b), axes=1) * jnp.asarray(scale, u.dtype)


def _gathered(w: Array) -> Array:
    """In automatic mode under a plan, `w` (a layer's adapter weight, whole over
    `tensor`) replicated: gathered over any other axis that splits it (`fsdp`),
    as FSDP gathers a weight before use. Left free, GSPMD splits the product's
    contraction over the unused tensor axis instead, moving the adapter between
    devices with collective-permutes (which XLA:CPU's simulated devices can run
    in different orders and deadlock on)."""
    plan = current_plan()
    if plan is None or not isinstance(w, jax.core.Tracer) or jax.sharding.get_abstract_mesh().manual_axes:
        return w
    return jax.lax.with_sharding_constraint(w, NamedSharding(plan.mesh, PartitionSpec()))
