"""A pre-norm transformer block made of the tensor-parallel layers."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import PlanError
from .._remat import name_activation
from ._attention import Attention
from ._block_config import BlockConfig
from ._dropout import Dropout
from ._linear import MLP
from ._lora import lora_dropout
from ._moe import MoE, MoEAux
from ._norm import LayerNorm, RMSNorm


class TransformerBlock(eqx.Module):
    """`x + attn(norm(x))`, then `+ mlp(norm(.))`, tensor parallel.

    Per block and direction, without sequence parallelism: two all-reduces (after
    the attention and MLP row-parallel outputs); with it: an all-gather before each
    column-parallel input and a reduce-scatter after each row-parallel output, the
    residual stream and norms staying on sequence blocks.

    **Arguments:** `d_model`, `d_hidden` (the feed-forward's hidden features: the
    MLP's, or each expert's); `config`, an `eqxpar.nn.BlockConfig` (the attention's
    `AttentionConfig`, the feed-forward's `activation` and optional `moe`
    `MoEConfig`, `norm`, `norm_eps`, `use_bias`, the residual `dropout`);
    keyword-only `axis="tensor"`, `dtype`, `key`.

    Dropout: the config's `dropout` is residual dropout after the attention and
    after the feed-forward, and its attention config's `dropout` drops attention
    probabilities (a hash-based mask equal on every path and device split); both
    apply when the call gets a `key`, the attention's split off it first,
    independent of the residual dropout's. With `config.moe` the feed-forward
    (`block.mlp`) is an `eqxpar.nn.MoE(d_model, d_hidden, config.moe, ...)` with
    the block's `activation`, `use_bias`, `axis` and `dtype`.

    Input and output `(batch, seq, d_model)` (the local sequence block under
    sequence parallelism in manual mode). A block with experts returns `(y, aux)`,
    `aux` the MoE's `MoEAux` (add its losses to the training loss yourself, or use
    `eqxpar.models.GPT`, which does); `eqxpar.nn.Stacked` stacks such aux over the
    layers.

    ```python
    attention = eqxpar.nn.AttentionConfig(8, rotary=True)
    config = eqxpar.nn.BlockConfig(attention, activation="swiglu", norm="rms")
    block = eqxpar.nn.TransformerBlock(256, 1024, config, key=key)
    y = block(x)                            # x: (batch, seq, 256)
    encoder = eqxpar.nn.BlockConfig(eqxpar.nn.AttentionConfig(8, causal=False), dropout=0.1)
    y = eqxpar.nn.TransformerBlock(256, 1024, encoder, key=key)(x, key=dropout_key)  # no key: no dropout
    y = block(x, segment_ids=seg)           # seg: (batch, seq) ids of the whole sequence
    moe = dataclasses.replace(config, moe=eqxpar.nn.MoEConfig(8, top_k=2))
    y, aux = eqxpar.nn.TransformerBlock(256, 512, moe, key=key)(x)  # aux.load_balance_loss, ...
    ```

    Calling it: `block(x, *, key=None, segment_ids=None, positions=None)`;
    `segment_ids` and `positions` go to the attention (see `Attention`), e.g.
    `model.blocks(h, segment_ids=seg, positions=pos)` through `eqxpar.nn.Stacked`.
    """

    norm1: LayerNorm | RMSNorm
    attn: Attention
    norm2: LayerNorm | RMSNorm
    # The feed-forward: the dense MLP, or an MoE with `config.moe` (same field, so
    # a dense block's structure and paths are what they were before MoE existed).
    mlp: MLP | MoE
    dropout: Dropout

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        config: BlockConfig,
        *,
        axis: str = "tensor",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if not isinstance(config, BlockConfig):
            raise PlanError(
                f"TransformerBlock(d_model, d_hidden, config={config!r}): expected an eqxpar.nn.BlockConfig, "
                "e.g. TransformerBlock(256, 1024, eqxpar.nn.BlockConfig(eqxpar.nn.AttentionConfig(8)), key=key)."
            )
        c = config
        k1, k2 = jax.random.split(key)
        norm = dict(use_bias=c.use_bias, eps=c.norm_eps, dtype=dtype)
        self.norm1 = _make_norm(c.norm, d_model, **norm)
        self.attn = Attention(d_model, c.attention, axis=axis, dtype=dtype, key=k1)
        self.norm2 = _make_norm(c.norm, d_model, **norm)
        layer = dict(activation=c.activation, use_bias=c.use_bias, axis=axis, dtype=dtype, key=k2)
        if c.moe is None:
            self.mlp = MLP(d_model, d_hidden, **layer)
        else:
            self.mlp = MoE(d_model, d_hidden, c.moe, **layer)
        self.dropout = Dropout(c.dropout)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        segment_ids: Int[Array, "_batch _seq"] | None = None,
        positions: Int[Array, "_batch _seq"] | None = None,
    ) -> Float[Array, "batch seq d_model"] | tuple[Float[Array, "batch seq d_model"], MoEAux]:
        k1 = k2 = k_attn = k_mlp = None
        if key is not None and (self.attn.dropout > 0 or lora_dropout(self.attn) > 0):
            # Split off first: the residual dropout's keys stay what they were
            # without attention dropout (or the adapters').
            key, k_attn = jax.random.split(key)
        if key is not None and lora_dropout(self.mlp) > 0:
            key, k_mlp = jax.random.split(key)
        if key is not None and self.dropout.rate > 0:
            k1, k2 = jax.random.split(key)
        # Named for a RematPolicy (an identity otherwise): MaxText's name.
        x = name_activation(x, "decoder_layer_input")
        h = self.attn(self.norm1(x), segment_ids=segment_ids, positions=positions, key=k_attn)
        x = x + self.dropout(h, key=k1)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.norm2(x))
            return x + self.dropout(y, key=k2), aux
        return x + self.dropout(self.mlp(self.norm2(x), key=k_mlp), key=k2)

    @property
    def experts(self) -> int:
        """The number of routed experts of the feed-forward (0: the dense MLP)."""
        return self.mlp.experts if isinstance(self.mlp, MoE) else 0


def _make_norm(
    norm: str, d_model: int, *, use_bias: bool, eps: float | None, dtype: Any
) -> LayerNorm | RMSNorm:
    """One of the block's two norms (`norm`: "layer" or "rms", checked by `BlockConfig`).
    Only a given epsilon is passed on: each norm keeps its own default."""
    given = {} if eps is None else {"eps": eps}
    if norm == "layer":
        return LayerNorm(d_model, use_bias=use_bias, dtype=dtype, **given)
    return RMSNorm(d_model, dtype=dtype, **given)
