"""The options of a `TransformerBlock`, checked once when they are given."""

import dataclasses

from .._config_check import check_bool, check_choice, check_rate, field_error, is_positive_finite
from .._errors import PlanError
from ._attention_config import AttentionConfig
from ._moe_config import MoEConfig

ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layer", "rms")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """What an `eqxpar.nn.TransformerBlock` computes, besides its widths: its
    attention's config, its feed-forward (a dense MLP, or a mixture of experts with
    `moe`), its norms and its residual dropout; frozen and hashable. Every field is
    checked when the config is built.

    **Fields:**

    - `attention`: an `eqxpar.nn.AttentionConfig` (heads, causal, rotary, kernel,
      attention dropout, the attention's biases).
    - `moe`: None (default: the feed-forward is a dense `eqxpar.nn.MLP`) or an
      `eqxpar.nn.MoEConfig`: the feed-forward is an `eqxpar.nn.MoE` of that
      routing, and the block returns `(y, aux)`.
    - `activation`: the feed-forward's, `"gelu"` (default) or `"swiglu"`.
    - `norm`: `"layer"` (default, `LayerNorm`) or `"rms"` (`RMSNorm`).
    - `norm_eps`: both norms' epsilon (default None: the norm's own, 1e-5 for
      LayerNorm, 1e-6 for RMSNorm).
    - `use_bias`: biases in the feed-forward and the LayerNorms (default True; the
      attention's are its config's `use_bias` and `qkv_bias`).
    - `dropout`: residual dropout after the attention and after the feed-forward
      (default 0.0), applied when the call gets a `key`.

    ```python
    config = eqxpar.nn.BlockConfig(eqxpar.nn.AttentionConfig(8, rotary=True),
                                   activation="swiglu", norm="rms")
    block = eqxpar.nn.TransformerBlock(256, 1024, config, key=key)
    ```
    """

    attention: AttentionConfig
    moe: MoEConfig | None = None
    activation: str = "gelu"
    norm: str = "layer"
    norm_eps: float | None = None
    use_bias: bool = True
    dropout: float = 0.0

    def __post_init__(self):
        owner = "BlockConfig"
        if not isinstance(self.attention, AttentionConfig):
            raise field_error(
                PlanError,
                owner,
                "expected an eqxpar.nn.AttentionConfig, e.g. attention=eqxpar.nn.AttentionConfig(8).",
                attention=self.attention,
            )
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise field_error(
                PlanError,
                owner,
                "expected None (a dense MLP) or an eqxpar.nn.MoEConfig, e.g. moe=eqxpar.nn.MoEConfig(8).",
                moe=self.moe,
            )
        check_choice(owner, "activation", self.activation, ACTIVATIONS)
        check_choice(owner, "norm", self.norm, NORMS)
        if self.norm_eps is not None and not is_positive_finite(self.norm_eps):
            raise field_error(
                PlanError,
                owner,
                "expected a small positive number (e.g. 1e-5) or None for the norm's default.",
                norm_eps=self.norm_eps,
            )
        check_bool(owner, "use_bias", self.use_bias)
        check_rate(owner, "dropout", self.dropout)
