"""Rotary position embeddings (RoPE) for queries and keys."""

import dataclasses
import math

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._errors import PlanError, SpecError


@dataclasses.dataclass(frozen=True)
class RotaryScaling:
    """Llama 3.1's rescaling of the rotary frequencies for a longer context
    (Hugging Face `rope_scaling={"rope_type": "llama3", ...}`); frozen and
    hashable, so layers keep it as a static field.

    A frequency `f` has wavelength `w = 2 pi / f`. Short wavelengths
    (`w < original_max_positions / high_freq_factor`) are kept, long ones
    (`w > original_max_positions / low_freq_factor`) are divided by `factor`, and
    those between are blended: `(1 - s) f / factor + s f` with
    `s = (original_max_positions / w - low_freq_factor) / (high_freq_factor -
    low_freq_factor)`, so the frequencies change continuously.

    **Fields:** `factor`, `low_freq_factor`, `high_freq_factor` (positive numbers,
    `high_freq_factor > low_freq_factor`) and `original_max_positions` (the context
    length the model was first trained at, a positive integer).

    ```python
    scaling = eqxpar.nn.RotaryScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_positions=8192)
    q = eqxpar.nn.apply_rotary(q, base=500000.0, scaling=scaling)
    ```
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"):
            value = getattr(self, name)
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not (numeric and math.isfinite(value) and value > 0):
                raise PlanError(f"RotaryScaling({name}={value!r}): expected a positive finite number.")
        if self.high_freq_factor <= self.low_freq_factor:
            raise PlanError(
                f"RotaryScaling(low_freq_factor={self.low_freq_factor}, high_freq_factor="
                f"{self.high_freq_factor}): the blend between them divides by their difference, so "
                "high_freq_factor must be larger (Llama 3.1 uses 1.0 and 4.0)."
            )

    def __call__(self, inv_freq: Float[Array, " half"]) -> Float[Array, " half"]:
        """The rescaled inverse frequencies (float32 in, float32 out)."""
        wavelength = 2 * math.pi / inv_freq
        context = float(self.original_max_positions)
        blend = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        slowed = inv_freq / self.factor
        mixed = (1 - blend) * slowed + blend * inv_freq
        out = jnp.where(wavelength > context / self.low_freq_factor, slowed, inv_freq)
        middle = (wavelength >= context / self.high_freq_factor) & (
            wavelength <= context / self.low_freq_factor
        )
        return jnp.where(middle, mixed, out)


def apply_rotary(
    x: Float[Array, "batch seq heads head_dim"],
    *,
    base: float = 10000.0,
    positions: Int[Array, "*rows positions"] | None = None,
    scaling: RotaryScaling | None = None,
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
    - `positions`: integer position of each of the `seq` tokens, `(seq,)`, or of
      each row's, `(batch, seq)` (left-padded rows of different lengths, as
      `eqxpar.models.generate` decodes them); default `0, 1, ..., seq - 1`.
    - `scaling`: a `RotaryScaling` applied to the frequencies (keyword-only;
      default None: unscaled).

    **Returns:** `x` rotated, same shape and dtype.

    ```python
    q = eqxpar.nn.apply_rotary(q)           # q: (batch, seq, heads, head_dim)
    ```
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise SpecError(
            f"apply_rotary: head_dim {head_dim} (shape {x.shape}) is odd; rotary embeddings turn "
            "feature pairs. Use an even head_dim (AttentionConfig(head_dim=...) or d_model / num_heads)."
        )
    seq = x.shape[1]
    if positions is None:
        positions = jnp.arange(seq)
    elif positions.shape not in ((seq,), (x.shape[0], seq)):
        raise SpecError(
            f"apply_rotary: positions of shape {positions.shape} do not match the sequence of x "
            f"(shape {x.shape}, seq {seq}). Give one position per token: shape ({seq},), or "
            f"({x.shape[0]}, {seq}) for positions per row."
        )
    half = head_dim // 2
    # Angles in float32 whatever x's dtype: low-precision positions * frequencies lose
    # the fine rotations of far-apart tokens.
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    if scaling is not None:
        inv_freq = scaling(inv_freq)
    # (rows, seq, half), rows 1 or batch.
    angles = jnp.atleast_2d(positions).astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    # Explicit broadcasting to (rows, seq, 1, half): rank promotion is "raise" in tests.
    cos = jnp.cos(angles).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
