"""Column- and row-parallel linear layers and the tensor-parallel MLP."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._errors import PlanError
from .._param import param
from .._remat import name_activation
from ._context import tensor_context
from ._lora import MLPLoRA, adapter_pairs, column_with_adapters, lora_dropout, row_adapter
from ._matmul import check_bias, check_split, column_matmul, lift, row_matmul


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Array:
    return (jax.random.normal(key, shape) / math.sqrt(fan_in)).astype(dtype)


class ColumnLinear(eqx.Module):
    """A linear layer whose output features are split over the tensor axis.

    Input `(batch, seq, in_features)` (under sequence parallelism, in manual mode,
    the local sequence block), output `(batch, seq, out_features)` with the
    features split over the axis (the whole sequence). Feeds a `RowLinear` without
    communication in between.

    **Arguments:** `in_features`, `out_features`; keyword-only `use_bias=True`,
    `axis="tensor"` (mesh axis), `dtype=jnp.float32`, `key`.

    ```python
    up = eqxpar.nn.ColumnLinear(256, 1024, key=k1)
    down = eqxpar.nn.RowLinear(1024, 256, key=k2)
    y = down(jax.nn.gelu(up(x)))            # x: (batch, seq, 256)
    ```
    """

    weight: Float[Array, "in_features out_features"] = param(axes=("embed", "mlp"))
    bias: Float[Array, " out_features"] | None = param(axes=("mlp",))
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    axis: str = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        axis: str = "tensor",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        self.weight = _normal(key, (in_features, out_features), in_features, dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.in_features, self.out_features, self.axis = in_features, out_features, axis

    def __call__(self, x: Float[Array, "batch seq_in in_features"]) -> Float[Array, "batch seq_out features"]:
        ctx = tensor_context(self.axis)
        check_split(self.weight.shape[1], self.out_features, ctx, what="ColumnLinear.weight (out_features)")
        check_bias(
            self.bias,
            self.out_features,
            ctx,
            what="ColumnLinear.bias",
            like="ColumnLinear.weight",
            split=True,
        )
        (y,) = column_matmul(x, [self.weight], ctx)
        return y if self.bias is None else y + lift(self.bias, y.ndim)


class RowLinear(eqx.Module):
    """A linear layer whose input features are split over the tensor axis; the
    partial products are summed over it (all-reduce, or reduce-scatter along the
    sequence under sequence parallelism).

    Input `(batch, seq, in_features)` with the features split (as a `ColumnLinear`
    leaves them), output `(batch, seq, out_features)` whole (or the local sequence
    block under sequence parallelism, in manual mode).

    **Arguments:** `in_features`, `out_features`; keyword-only `use_bias=True`,
    `axis="tensor"`, `dtype=jnp.float32`, `key`.
    """

    weight: Float[Array, "in_features out_features"] = param(axes=("mlp", "embed"))
    bias: Float[Array, " out_features"] | None = param(axes=("embed",))
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    axis: str = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        axis: str = "tensor",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        self.weight = _normal(key, (in_features, out_features), in_features, dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.in_features, self.out_features, self.axis = in_features, out_features, axis

    def __call__(
        self, x: Float[Array, "batch seq_in features"]
    ) -> Float[Array, "batch seq_out out_features"]:
        ctx = tensor_context(self.axis)
        check_split(self.weight.shape[0], self.in_features, ctx, what="RowLinear.weight (in_features)")
        check_bias(
            self.bias, self.out_features, ctx, what="RowLinear.bias", like="RowLinear.weight", split=False
        )
        y = row_matmul(x, self.weight, ctx)
        return y if self.bias is None else y + lift(self.bias, y.ndim)


_ACTIVATIONS = ("gelu", "swiglu")


class MLP(eqx.Module):
    """The transformer feed-forward block, tensor parallel: a column-parallel input
    projection, the activation on local hidden features, a row-parallel output.

    `activation="gelu"`: `W_out gelu(W_in x)`. `activation="swiglu"`:
    `W_out (silu(W_gate x) * W_up x)`, with gate and up stored as one weight
    `(d_model, 2, d_hidden)` so they share one gather of `x`.

    **Arguments:** `d_model`, `d_hidden`; keyword-only `activation="gelu"`,
    `use_bias=True`, `axis="tensor"`, `dtype=jnp.float32`, `key`.

    Calling it: `mlp(x, *, key=None)`, input and output `(batch, seq, d_model)`
    (the local sequence block under sequence parallelism in manual mode); `key`:
    for the adapters' dropout (`lora.dropout`; without it none).
    """

    w_in: Float[Array, "d_model n_in d_hidden"] = param(axes=("embed", None, "mlp"))
    b_in: Float[Array, "n_in d_hidden"] | None = param(axes=(None, "mlp"))
    w_out: Float[Array, "d_hidden d_model"] = param(axes=("mlp", "embed"))
    b_out: Float[Array, " d_model"] | None = param(axes=("embed",))
    d_model: int = eqx.field(static=True)
    d_hidden: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    # Low-rank adapters on gate, up and down (`eqxpar.models.add_lora`); None: none.
    lora: MLPLoRA | None = None

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        activation: str = "gelu",
        use_bias: bool = True,
        axis: str = "tensor",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if activation not in _ACTIVATIONS:
            raise PlanError(f"MLP(activation={activation!r}): expected one of {_ACTIVATIONS}.")
        n_in = 2 if activation == "swiglu" else 1
        k1, k2 = jax.random.split(key)
        self.w_in = _normal(k1, (d_model, n_in, d_hidden), d_model, dtype)
        self.b_in = jnp.zeros((n_in, d_hidden), dtype) if use_bias else None
        self.w_out = _normal(k2, (d_hidden, d_model), d_hidden, dtype)
        self.b_out = jnp.zeros((d_model,), dtype) if use_bias else None
        self.d_model, self.d_hidden, self.activation, self.axis = d_model, d_hidden, activation, axis
        self.lora = None

    def __call__(
        self, x: Float[Array, "batch seq_in d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "batch seq_out d_model"]:
        ctx = tensor_context(self.axis)
        k_in = k_out = None
        if key is not None and lora_dropout(self) > 0:
            k_in, k_out = jax.random.split(key)
        check_split(self.w_in.shape[2], self.d_hidden, ctx, what="MLP.w_in (d_hidden)")
        check_split(self.w_out.shape[0], self.d_hidden, ctx, what="MLP.w_out (d_hidden)")
        check_bias(self.b_in, self.d_hidden, ctx, what="MLP.b_in", like="MLP.w_in", split=True)
        check_bias(self.b_out, self.d_model, ctx, what="MLP.b_out", like="MLP.w_out", split=False)
        if self.lora is None:
            (h,) = column_matmul(x, [self.w_in], ctx)  # (batch, seq, n_in, hidden)
        else:
            h = self._adapted_input(x, ctx, k_in)
        # The hidden state before the activation, named for a RematPolicy.
        h = name_activation(h, "mlpwi")
        if self.b_in is not None:
            h = h + lift(self.b_in, h.ndim)
        if self.activation == "gelu":
            h = jax.nn.gelu(h[:, :, 0])
        else:
            h = jax.nn.silu(h[:, :, 0]) * h[:, :, 1]
        h = ctx.constrain(h, None, ctx.axis)
        y = row_matmul(h, self.w_out, ctx)
        lora = self.lora
        if lora is not None and lora.down_a is not None:
            drop = dict(dropout=lora.dropout, key=k_out)
            y = y + row_adapter(h, lora.down_a, lora.down_b, lora.scale, ctx, in_dims=1, **drop)
        y = name_activation(y, "mlpwo")
        return y if self.b_out is None else y + lift(self.b_out, y.ndim)

    def _adapted_input(self, x: Array, ctx, key: PRNGKeyArray | None) -> Array:
        # The input projection with the gate / up adapters' outputs added to their
        # halves of the stacked (batch, seq, n_in, hidden) result.
        pairs = adapter_pairs(self.lora, ("gate", "up"))
        drop = dict(dropout=self.lora.dropout, key=key)
        (h,), deltas = column_with_adapters(x, [self.w_in], pairs, self.lora.scale, ctx, split_dim=-1, **drop)
        if not deltas:
            return h
        found = {name: delta for (name, _, _), delta in zip(pairs, deltas, strict=True)}
        # A GELU MLP's one input projection is `up`; SwiGLU's are (gate, up).
        slots = ("up",) if h.shape[2] == 1 else ("gate", "up")
        zero = jnp.zeros_like(deltas[0])
        return h + jnp.stack([found.get(name, zero) for name in slots], axis=2)
