"""Which manual mesh axes a value varies along, and marking it varying along more.

Shared by the eqxpar packages (the collectives, `eqxpar.nn`'s layers, the gradient
implementations and `eqxpar.pipeline`); its names are internal, not public API.

Inside `jax.shard_map` with `check_vma=True`, JAX types every value with the
manual axes along which it may differ between devices. Both helpers read that
type through `jax.typeof(x).manual_axis_type`, the one spelling every supported
JAX release (0.10.2 to 0.12) has, for arrays, tracers and `jax.ShapeDtypeStruct`s
alike. With `check_vma=False` JAX tracks nothing and every value reads as varying
along no axis.
"""

from collections.abc import Collection
from typing import Any

import jax
from jax import lax
from jaxtyping import Array


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes along which `x` (an array, a tracer or a
    `jax.ShapeDtypeStruct`) may differ between devices."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def mark_varying(x: Array, axes: Collection[str]) -> Array:
    """`x` typed as varying along the manual `axes` (it may differ between those
    devices). Axes `x` already varies along are skipped (`pcast` rejects them), so
    marking twice is a no-op.

    Parameters marked so get per-device gradients (no implicit psum), and scan
    carries and switch branches get one type. Marking once, before a loop, also
    keeps JAX from casting inside the loop body, whose transpose (a psum) would
    then run once per step of the backward pass."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x
