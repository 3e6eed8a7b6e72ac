"""Rotary position embeddings (RoPE) for queries and keys."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._errors import SpecError


def apply_rotary(
    x: Float[Array, "batch seq heads head_dim"],
    *,
    base: float = 10000.0,
    positions: Int[Array, " positions"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate each head's feature pairs by an angle proportional to the token's position.

    Feature `i` and `i + head_dim / 2` of a head form a pair (the "rotate half"
    layout of GPT-NeoX and LLaMA), turned by `position * base ** (-2 i / head_dim)`.
    Applied to queries and keys, the score of query `m` and key `n` depends on
    their positions only through `m - n`.

    Heads are independent, so this needs no communication in any mode: it runs on
    a device's local heads. It needs the *whole* sequence (or explicit global
    `positions`): the layers call it after the column-parallel projections, which
    hold the whole sequence in every mode.

    **Arguments:**

    - `x`: queries or keys, `(batch, seq, heads, head_dim)`, `head_dim` even.
    - `base`: the wavelength base (keyword-only).
    - `positions`: integer position of each of the `seq` tokens; default
      `0, 1, ..., seq - 1`.

    **Returns:** `x` rotated, same shape and dtype.

    ```python
    q = eqxpar.nn.apply_rotary(q)           # q: (batch, seq, heads, head_dim)
    ```
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise SpecError(
            f"apply_rotary: head_dim {head_dim} (shape {x.shape}) is odd; rotary embeddings turn "
            "feature pairs. Use an even head_dim (Attention(head_dim=...) or d_model / num_heads)."
        )
    seq = x.shape[1]
    if positions is None:
        positions = jnp.arange(seq)
    elif positions.shape != (seq,):
        raise SpecError(
            f"apply_rotary: positions of shape {positions.shape} do not match the sequence of x "
            f"(shape {x.shape}, seq {seq}). Give one position per token: shape ({seq},)."
        )
    half = head_dim // 2
    # Angles in float32 whatever x's dtype: low-precision positions * frequencies lose
    # the fine rotations of far-apart tokens.
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, half)
    # Explicit broadcasting to (1, seq, 1, half): rank promotion is "raise" in tests.
    cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
