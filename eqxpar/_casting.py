"""Casting a pytree's floating-point arrays to a dtype.

Shared by the train step (`Plan(param_dtype=...)` when a state is built, the
compute dtype inside the differentiated function) and `eqxpar.nn.Stacked`, which
casts one layer's weights at a time inside its loop.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree


def cast_floating(tree: PyTree, dtype: Any, *, per_layer: bool = False) -> PyTree:
    """`tree` with every floating-point array cast to `dtype` (others unchanged).

    `per_layer=True` (the compute dtype of a step) leaves alone the weights of a
    module that casts them itself, one layer at a time inside its loop (a module
    whose `casts_per_layer()` is True: an `eqxpar.nn.Stacked`). Cast here, a stack
    could exist twice, and its gradient in both dtypes, for the whole step (on
    XLA:CPU a bf16 GPT held 16 MiB of temporaries per layer that way, 11 cast per
    layer; the TPU compiler avoided the copy either way)."""

    def cast(x: Any) -> Any:
        if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    if not per_layer:
        return jax.tree.map(cast, tree)
    casts_itself = lambda x: callable(getattr(x, "casts_per_layer", None)) and x.casts_per_layer()  # noqa: E731
    return jax.tree.map(lambda x: x if casts_itself(x) else cast(x), tree, is_leaf=casts_itself)
