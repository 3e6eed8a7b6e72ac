"""A pre-norm transformer block made of the tensor-parallel layers."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import PlanError
from ._attention import Attention
from ._attention_config import AttentionConfig
from ._dropout import Dropout
from ._linear import MLP
from ._moe import MoE, MoEAux
from ._moe_config import MoEConfig
from ._norm import LayerNorm, RMSNorm
from ._rotary import RotaryScaling


class TransformerBlock(eqx.Module):
    """`x + attn(norm(x))`, then `+ mlp(norm(.))`, tensor parallel.

    Per block and direction, without sequence parallelism: two all-reduces (after
    the attention and MLP row-parallel outputs); with it: an all-gather before each
    column-parallel input and a reduce-scatter after each row-parallel output, the
    residual stream and norms staying on sequence blocks.

    **Arguments:** `d_model`, `num_heads`, `d_hidden`; keyword-only
    `num_kv_heads=None`, `activation="gelu"|"swiglu"`, `norm="layer"|"rms"`,
    `use_bias=True`, `fused_qkv=False`, `rotary=False` (rotary position embeddings
    in the attention), `rotary_base=10000.0`, `attention="auto"` and
    `attention_block=512` (how the attention attends: see `Attention`),
    `qkv_bias=None` and `rotary_scaling=None` (as `Attention`'s), `norm_eps=None`
    (both norms' epsilon; None: the norm's default, 1e-5 for LayerNorm, 1e-6 for
    RMSNorm),
    `axis="tensor"`, `dtype`, `key`; `causal=True` (False: an encoder block,
    every position attends to every other) and `dropout=0.0` (residual dropout
    after the attention and after the MLP, applied when the call gets a `key`),
    `attention_dropout=0.0` (dropout on the attention probabilities: `Attention`'s
    `dropout`, a hash-based mask equal on every path and device split; its key is
    split off the call's `key`, independent of the residual dropout's).

    Mixture of experts (keyword-only): `experts=0` keeps the dense MLP; `experts > 0`
    makes the feed-forward (`block.mlp`) an `eqxpar.nn.MoE(d_model, d_hidden,
    experts, ...)` with the block's `activation`, `use_bias`, `axis` and `dtype`,
    `top_k` (default 2), `moe_score` (`"softmax"`, default, or `"sigmoid"`: the
    MoE's `score`), `num_shared_experts` (default 0: the MoE's `num_shared`) and
    `capacity_factor` (default None: dropless). These four are MoE options: giving
    one with `experts=0` is a `PlanError`.

    Input and output `(batch, seq, d_model)` (the local sequence block under
    sequence parallelism in manual mode). A block with experts returns `(y, aux)`,
    `aux` the MoE's `MoEAux` (add its losses to the training loss yourself, or use
    `eqxpar.models.GPT`, which does); `eqxpar.nn.Stacked` stacks such aux over the
    layers.

    ```python
    block = eqxpar.nn.TransformerBlock(256, 8, 1024, activation="swiglu", norm="rms",
                                       rotary=True, key=key)
    y = block(x)                            # x: (batch, seq, 256)
    encoder = eqxpar.nn.TransformerBlock(256, 8, 1024, causal=False, dropout=0.1, key=key)
    y = encoder(x, key=dropout_key)         # without key: no dropout
    y = block(x, segment_ids=seg)           # seg: (batch, seq) ids of the whole sequence
    moe = eqxpar.nn.TransformerBlock(256, 8, 512, experts=8, top_k=2, key=key)
    y, aux = moe(x)                         # aux.load_balance_loss, aux.expert_load, ...
    ```

    Calling it: `block(x, *, key=None, segment_ids=None)`; `segment_ids` go to the
    attention (see `Attention`), e.g. `model.blocks(h, segment_ids=seg)` through
    `eqxpar.nn.Stacked`.
    """

    norm1: LayerNorm | RMSNorm
    attn: Attention
    norm2: LayerNorm | RMSNorm
    # The feed-forward: the dense MLP, or an MoE with `experts > 0` (same field, so
    # a dense block's structure and paths are what they were before MoE existed).
    mlp: MLP | MoE
    dropout: Dropout

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_hidden: int,
        *,
        num_kv_heads: int | None = None,
        activation: str = "gelu",
        norm: str = "layer",
        use_bias: bool = True,
        fused_qkv: bool = False,
        rotary: bool = False,
        rotary_base: float = 10000.0,
        rotary_scaling: RotaryScaling | None = None,
        qkv_bias: bool | None = None,
        norm_eps: float | None = None,
        attention: str = "auto",
        attention_block: int = 512,
        axis: str = "tensor",
        dtype=jnp.float32,
        causal: bool = True,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        experts: int = 0,
        # None: not given (2, 'softmax', 0 with experts), so that an MoE option
        # given to a dense block is caught instead of silently ignored.
        top_k: int | None = None,
        moe_score: str | None = None,
        num_shared_experts: int | None = None,
        # Any: checked by MoE with an eqxpar error naming the fix.
        capacity_factor: Any = None,
        key: PRNGKeyArray,
    ):
        moe = _MoEOptions(top_k, moe_score, num_shared_experts, capacity_factor)
        _check_options(norm, experts, moe)
        k1, k2 = jax.random.split(key)
        self.norm1 = _make_norm(norm, d_model, use_bias=use_bias, eps=norm_eps, dtype=dtype)
        attention_config = AttentionConfig(
            num_heads,
            num_kv_heads=num_kv_heads,
            causal=causal,
            fused_qkv=fused_qkv,
            rotary=rotary,
            rotary_base=rotary_base,
            rotary_scaling=rotary_scaling,
            kernel=attention,
            block_size=attention_block,
            dropout=attention_dropout,
            use_bias=use_bias,
            qkv_bias=qkv_bias,
        )
        self.attn = Attention(d_model, attention_config, axis=axis, dtype=dtype, key=k1)
        self.norm2 = _make_norm(norm, d_model, use_bias=use_bias, eps=norm_eps, dtype=dtype)
        self.mlp = _make_feed_forward(
            d_model,
            d_hidden,
            experts,
            moe,
            activation=activation,
            use_bias=use_bias,
            axis=axis,
            dtype=dtype,
            key=k2,
        )
        self.dropout = Dropout(dropout)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        segment_ids: Int[Array, "_batch _seq"] | None = None,
    ) -> Float[Array, "batch seq d_model"] | tuple[Float[Array, "batch seq d_model"], MoEAux]:
        k1 = k2 = k_attn = None
        if key is not None and self.attn.dropout > 0:
            # Split off first: the residual dropout's keys stay what they were
            # without attention dropout.
            key, k_attn = jax.random.split(key)
        if key is not None and self.dropout.rate > 0:
            k1, k2 = jax.random.split(key)
        h = self.attn(self.norm1(x), segment_ids=segment_ids, key=k_attn)
        x = x + self.dropout(h, key=k1)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.norm2(x))
            return x + self.dropout(y, key=k2), aux
        return x + self.dropout(self.mlp(self.norm2(x)), key=k2)

    @property
    def experts(self) -> int:
        """The number of routed experts of the feed-forward (0: the dense MLP)."""
        return self.mlp.experts if isinstance(self.mlp, MoE) else 0


@dataclasses.dataclass(frozen=True)
class _MoEOptions:
    """`TransformerBlock`'s mixture-of-experts options as given (None: not given),
    named as the block's arguments are."""

    top_k: int | None
    moe_score: str | None
    num_shared_experts: int | None
    capacity_factor: Any

    def given(self) -> list[str]:
        """The options given, as `name=value` (for messages)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return [f"{name}={value!r}" for name, value in values.items() if value is not None]


def _check_options(norm: str, experts: Any, moe: _MoEOptions) -> None:
    """The checks of `TransformerBlock`'s own options (the layers check theirs):
    the norm's name, the number of experts, and no MoE option on a dense block."""
    if norm not in ("layer", "rms"):
        raise PlanError(f"TransformerBlock(norm={norm!r}): expected 'layer' or 'rms'.")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise PlanError(
            f"TransformerBlock(experts={experts!r}): expected an integer >= 0 (0: the dense MLP; "
            "n > 0: a mixture of n experts), e.g. experts=8."
        )
    given = moe.given()
    if not experts and given:
        raise PlanError(
            f"TransformerBlock({', '.join(given)}) with experts=0: these are mixture-of-experts "
            "options and a block with experts=0 has a dense MLP. Pass experts > 0 (e.g. experts=8) "
            "for an MoE block, or drop them."
        )


def _make_norm(
    norm: str, d_model: int, *, use_bias: bool, eps: float | None, dtype: Any
) -> LayerNorm | RMSNorm:
    """One of the block's two norms (`norm`: "layer" or "rms", already checked).
    Only a given epsilon is passed on: each norm keeps its own default."""
    given = {} if eps is None else {"eps": eps}
    if norm == "layer":
        return LayerNorm(d_model, use_bias=use_bias, dtype=dtype, **given)
    return RMSNorm(d_model, dtype=dtype, **given)


def _make_feed_forward(
    d_model: int,
    d_hidden: int,
    experts: int,
    moe: _MoEOptions,
    *,
    activation: str,
    use_bias: bool,
    axis: str,
    dtype: Any,
    key: PRNGKeyArray,
) -> MLP | MoE:
    """The block's feed-forward: the dense MLP with `experts=0`, else an MoE whose
    options not given take the MoE's defaults."""
    if not experts:
        return MLP(
            d_model, d_hidden, activation=activation, use_bias=use_bias, axis=axis, dtype=dtype, key=key
        )
    config = MoEConfig(
        experts,
        top_k=2 if moe.top_k is None else moe.top_k,
        score="softmax" if moe.moe_score is None else moe.moe_score,
        capacity_factor=moe.capacity_factor,
        num_shared=moe.num_shared_experts or 0,
    )
    return MoE(
        d_model, d_hidden, config, activation=activation, use_bias=use_bias, axis=axis, dtype=dtype, key=key
    )
