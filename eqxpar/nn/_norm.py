"""Normalisations over the feature dimension. They need no communication in any
mode: without sequence parallelism every tensor device normalises the whole
(replicated) activation; with it, each normalises its own sequence block."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._param import param
from ._matmul import lift


class LayerNorm(eqx.Module):
    """LayerNorm over the last dimension, with learned scale and (optional) shift.

    **Arguments:** `d_model`; keyword-only `eps=1e-5`, `use_bias=True`, `dtype`.
    Input and output `(..., d_model)`.
    """

    weight: Float[Array, " d_model"] = param(axes=("embed",))
    bias: Float[Array, " d_model"] | None = param(axes=("embed",))
    eps: float = eqx.field(static=True)

    def __init__(self, d_model: int, *, eps: float = 1e-5, use_bias: bool = True, dtype=jnp.float32):
        self.weight = jnp.ones((d_model,), dtype)
        self.bias = jnp.zeros((d_model,), dtype) if use_bias else None
        self.eps = eps

    def __call__(self, x: Float[Array, "*shape d_model"]) -> Float[Array, "*shape d_model"]:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * lift(self.weight, x.ndim)
        return y if self.bias is None else y + lift(self.bias, x.ndim)


class RMSNorm(eqx.Module):
    """RMSNorm over the last dimension with a learned scale.

    **Arguments:** `d_model`; keyword-only `eps=1e-6`, `dtype`. Input and output
    `(..., d_model)`.
    """

    weight: Float[Array, " d_model"] = param(axes=("embed",))
    eps: float = eqx.field(static=True)

    def __init__(self, d_model: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = jnp.ones((d_model,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*shape d_model"]) -> Float[Array, "*shape d_model"]:
        scale = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return x * scale * lift(self.weight, x.ndim)
