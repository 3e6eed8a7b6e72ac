"""Pooling the sequence into one vector per example, in every mode."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._context import tensor_context


def mean_pool(h: Float[Array, "batch seq *rest"], *, axis: str = "tensor") -> Float[Array, "batch ..."]:
    """The mean of `h` over the sequence (dimension 1).

    Under sequence parallelism in a manual region over `axis` each device holds
    one equal-sized sequence block (`split_sequence`), so the global mean is the
    local mean averaged over `axis`; elsewhere it is `jnp.mean(h, axis=1)`.

    ```python
    pooled = eqxpar.nn.mean_pool(h)         # (batch, d_model)
    ```
    """
    ctx = tensor_context(axis)
    local = jnp.mean(h, axis=1)
    if ctx.manual and ctx.sequence_parallel:
        return jax.lax.pmean(local, axis)
    return local


def first_token(h: Float[Array, "batch seq *rest"], *, axis: str = "tensor") -> Float[Array, "batch ..."]:
    """The first position of the sequence, `h[:, 0]` (e.g. a `[CLS]` token).

    Under sequence parallelism in a manual region over `axis` the first token
    lives on device 0 of `axis` (the first sequence block); it is broadcast to
    every device with a sum over `axis` of the value masked to device 0.

    ```python
    cls = eqxpar.nn.first_token(h)          # (batch, d_model)
    ```
    """
    ctx = tensor_context(axis)
    local = h[:, 0]
    if ctx.manual and ctx.sequence_parallel:
        mine = jax.lax.axis_index(axis) == 0
        return jax.lax.psum(jnp.where(mine, local, jnp.zeros_like(local)), axis)
    return local
