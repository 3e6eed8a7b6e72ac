"""Pooling the sequence into one vector per example, in every mode."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._context_split import context_size
from .._mesh import CONTEXT_AXIS
from ._context import tensor_context


def _split_axes(axis: str) -> tuple[str, ...]:
    # The manual axes this device's sequence is a part of: `context` (context
    # parallelism), then the tensor axis (sequence parallelism).
    ctx = tensor_context(axis)
    tensor = (axis,) if ctx.manual and ctx.sequence_parallel else ()
    return ((CONTEXT_AXIS,) if context_size() > 1 else ()) + tensor


def mean_pool(h: Float[Array, "batch seq *rest"], *, axis: str = "tensor") -> Float[Array, "batch ..."]:
    """The mean of `h` over the sequence (dimension 1).

    Under sequence parallelism in a manual region over `axis`, and under context
    parallelism, each device holds an equal-sized part of the sequence
    (`split_sequence`), so the global mean is the local mean averaged over `axis`
    and `context`; elsewhere it is `jnp.mean(h, axis=1)`.

    ```python
    pooled = eqxpar.nn.mean_pool(h)         # (batch, d_model)
    ```
    """
    local = jnp.mean(h, axis=1)
    axes = _split_axes(axis)
    return jax.lax.pmean(local, axes) if axes else local


def first_token(h: Float[Array, "batch seq *rest"], *, axis: str = "tensor") -> Float[Array, "batch ..."]:
    """The first position of the sequence, `h[:, 0]` (e.g. a `[CLS]` token).

    Under sequence parallelism in a manual region over `axis` (and under context
    parallelism) the first token lives on device 0 of `axis` (and of `context`:
    the first sequence block); it is broadcast to every device with a sum over
    those axes of the value masked to that device.

    ```python
    cls = eqxpar.nn.first_token(h)          # (batch, d_model)
    ```
    """
    local = h[:, 0]
    axes = _split_axes(axis)
    if not axes:
        return local
    mine = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes]))
    return jax.lax.psum(jnp.where(mine, local, jnp.zeros_like(local)), axes)
