"""The options of an `Attention` layer, checked once when they are given."""

import dataclasses

from .._config_check import (
    check_bool,
    check_choice,
    check_positive_int,
    check_rate,
    field_error,
    is_positive_finite,
)
from .._errors import DivisibilityError, PlanError
from ._rotary import RotaryScaling

KERNELS = ("auto", "blockwise", "dense")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What an `eqxpar.nn.Attention` layer computes, besides its width; frozen and
    hashable. Every field is checked when the config is built, so a bad one names
    itself (an eqxpar error) instead of failing inside the layer.

    **Fields:**

    - `num_heads`: query heads.
    - `num_kv_heads`: key/value heads for grouped-query attention (default None:
      `num_heads`); must divide `num_heads`. Both head counts must be divisible by
      the tensor axis size.
    - `head_dim`: default None: `d_model // num_heads`.
    - `fused_qkv`: store Q, K and V as one weight `(d_model, 3, heads, head_dim)`
      (needs as many key/value heads as query heads); else three weights. Either
      way the projections share one gather of the input.
    - `causal`: apply a causal mask (default True; False: every position attends
      to every other, an encoder).
    - `rotary`: rotate queries and keys by their positions (rotary position
      embeddings, `eqxpar.nn.apply_rotary`; default False). `head_dim` must be even.
    - `rotary_base`: the rotary wavelength base (default 10000.0).
    - `rotary_scaling`: a `RotaryScaling` of the rotary frequencies (Llama 3.1's
      long-context rescaling; default None: unscaled).
    - `kernel`: how the local heads attend. `"auto"` (default): cuDNN's fused
      attention on GPU where it applies, else `eqxpar.nn.blockwise_attention`
      (online softmax over key blocks, temp memory linear in the sequence) when
      the sequence is longer than one block, else dense. `"blockwise"` or
      `"dense"` (the `(seq, seq)` score matrix) force one.
    - `block_size`: keys per block of the blockwise kernel (default 512).
    - `dropout`: dropout rate on the attention probabilities (default 0.0; see
      `Attention`).
    - `use_bias`: biases on the projections (default True).
    - `qkv_bias`: biases on the query, key and value projections only (default
      None: as `use_bias`; Qwen2's layout is `qkv_bias=True, use_bias=False`).

    ```python
    config = eqxpar.nn.AttentionConfig(8, num_kv_heads=2, rotary=True)
    attn = eqxpar.nn.Attention(256, config, key=key)
    ```
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    fused_qkv: bool = False
    causal: bool = True
    rotary: bool = False
    rotary_base: float = 10000.0
    rotary_scaling: RotaryScaling | None = None
    kernel: str = "auto"
    block_size: int = 512
    dropout: float = 0.0
    use_bias: bool = True
    qkv_bias: bool | None = None

    def __post_init__(self):
        owner = "AttentionConfig"
        check_positive_int(owner, "num_heads", self.num_heads)
        check_positive_int(owner, "num_kv_heads", self.num_kv_heads, optional=True)
        check_positive_int(owner, "head_dim", self.head_dim, optional=True)
        for name in ("fused_qkv", "causal", "rotary", "use_bias"):
            check_bool(owner, name, getattr(self, name))
        check_bool(owner, "qkv_bias", self.qkv_bias, optional=True)
        check_choice(owner, "kernel", self.kernel, KERNELS)
        check_positive_int(owner, "block_size", self.block_size)
        check_rate(owner, "dropout", self.dropout)
        if not is_positive_finite(self.rotary_base):
            # The rotary frequencies are base ** (-2i / head_dim): NaN for a base <= 0.
            raise field_error(
                PlanError,
                owner,
                "expected a positive finite number (the rotary wavelength base); the usual value is 10000.0.",
                rotary_base=self.rotary_base,
            )
        if self.rotary_scaling is not None and not isinstance(self.rotary_scaling, RotaryScaling):
            raise field_error(
                PlanError,
                owner,
                "expected an eqxpar.nn.RotaryScaling or None.",
                rotary_scaling=self.rotary_scaling,
            )
        self._check_heads()

    def _check_heads(self) -> None:
        heads, kv = self.num_heads, self.kv_heads
        if heads % kv:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise field_error(
                DivisibilityError,
                "AttentionConfig",
                "each key/value head serves an equal group of query heads, so num_kv_heads must divide "
                f"num_heads. Use one of {divisors}, or None for num_heads.",
                num_heads=heads,
                num_kv_heads=kv,
            )
        if self.fused_qkv and kv != heads:
            raise field_error(
                PlanError,
                "AttentionConfig",
                f"a fused QKV weight holds as many key/value heads as query heads ({heads}). Use "
                "fused_qkv=False for grouped-query attention, or num_kv_heads=None.",
                fused_qkv=True,
                num_kv_heads=kv,
            )
        if self.rotary and self.head_dim is not None and self.head_dim % 2:
            raise _odd_head_dim(self.head_dim, "")

    @property
    def kv_heads(self) -> int:
        """The key/value heads: `num_kv_heads`, or `num_heads` when it is None."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def head_dim_for(self, d_model: int) -> int:
        """The head width of a layer `d_model` wide: `head_dim`, or `d_model //
        num_heads` when it is None (checked even when `rotary`)."""
        if self.head_dim is not None:
            return self.head_dim
        hd = d_model // self.num_heads
        if self.rotary and hd % 2:
            raise _odd_head_dim(hd, f" = d_model / num_heads = {d_model} / {self.num_heads}")
        return hd


def _odd_head_dim(head_dim: int, derived: str) -> DivisibilityError:
    return field_error(  # type: ignore[return-value]
        DivisibilityError,
        "AttentionConfig",
        f"head_dim{derived} is odd, and rotary embeddings turn pairs of features, so head_dim must be "
        "even. Pass an even head_dim (or d_model and num_heads with an even quotient).",
        rotary=True,
        head_dim=head_dim,
    )
