"""Shared by the cost readers (`eqxpar.inspect`'s minimum, table and jaxpr walk,
and the advisor): the byte size of an array from its shape and dtype, in one
place. (`eqxpar.inspect`'s HLO reader maps HLO's own type names to bytes: text,
not dtypes.)"""

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp


def itemsize(dtype: Any) -> int:
    """Bytes of one element of `dtype`: a NumPy or JAX dtype, a scalar type
    (`jnp.float32`), or a typed PRNG key's dtype (`key<fry>`: 8 bytes).

    ```python
    itemsize(jnp.bfloat16)  # 2
    ```
    """
    size = getattr(dtype, "itemsize", None)
    return size if isinstance(size, int) else jnp.dtype(dtype).itemsize


def array_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of an array of `shape` and `dtype` (see `itemsize`).

    ```python
    array_bytes((4, 8), jnp.float32)  # 128
    ```
    """
    return math.prod(shape) * itemsize(dtype)


def nbytes(x: Any) -> int:
    """Bytes of `x`: anything with a `shape` and a `dtype` (an array, a
    `jax.ShapeDtypeStruct`, an abstract value)."""
    return array_bytes(x.shape, x.dtype)
