"""Dropout as an Equinox module."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, Shaped

from .._errors import PlanError


class Dropout(eqx.Module):
    """Zero each element with probability `rate` and scale the rest by `1/(1-rate)`.

    **Arguments:** `rate` in `[0, 1)`; keyword-only `inference=False` (when True,
    the module is the identity).

    Calling it, `dropout(x, *, key=None, inference=None)`, returns `x` unchanged
    when `rate` is 0, in inference (the call's `inference`, else the module's) or
    without a `key`; otherwise it masks `x` with `jax.random.bernoulli(key, 1-rate)`.

    ```python
    drop = eqxpar.nn.Dropout(0.1)
    y = drop(x, key=key)
    ```
    """

    rate: float = eqx.field(static=True)
    inference: bool = eqx.field(static=True)

    def __init__(self, rate: float = 0.5, *, inference: bool = False):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) < 1.0:
            raise PlanError(f"Dropout(rate={rate!r}): expected a number in [0, 1).")
        self.rate = float(rate)
        self.inference = bool(inference)

    def __call__(
        self,
        x: Shaped[Array, "..."],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Shaped[Array, "..."]:
        inference = self.inference if inference is None else inference
        if self.rate == 0.0 or inference or key is None:
            return x
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(key, keep, x.shape)
        return jnp.where(mask, x / jnp.asarray(keep, dtype=x.dtype), jnp.zeros((), x.dtype))
