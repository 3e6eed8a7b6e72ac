"""A pre-norm transformer block made of the tensor-parallel layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import PlanError
from ._attention import Attention
from ._dropout import Dropout
from ._linear import MLP
from ._norm import LayerNorm, RMSNorm


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
    `axis="tensor"`, `dtype`, `key`; `causal=True` (False: an encoder block,
    every position attends to every other) and `dropout=0.0` (residual dropout
    after the attention and after the MLP, applied when the call gets a `key`),
    `attention_dropout=0.0` (dropout on the attention probabilities: `Attention`'s
    `dropout`, a hash-based mask equal on every path and device split; its key is
    split off the call's `key`, independent of the residual dropout's).

    Input and output `(batch, seq, d_model)` (the local sequence block under
    sequence parallelism in manual mode).

    ```python
    block = eqxpar.nn.TransformerBlock(256, 8, 1024, activation="swiglu", norm="rms",
                                       rotary=True, key=key)
    y = block(x)                            # x: (batch, seq, 256)
    encoder = eqxpar.nn.TransformerBlock(256, 8, 1024, causal=False, dropout=0.1, key=key)
    y = encoder(x, key=dropout_key)         # without key: no dropout
    y = block(x, segment_ids=seg)           # seg: (batch, seq) ids of the whole sequence
    ```

    Calling it: `block(x, *, key=None, segment_ids=None)`; `segment_ids` go to the
    attention (see `Attention`), e.g. `model.blocks(h, segment_ids=seg)` through
    `eqxpar.nn.Stacked`.
    """

    norm1: LayerNorm | RMSNorm
    attn: Attention
    norm2: LayerNorm | RMSNorm
    mlp: MLP
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
        attention: str = "auto",
        attention_block: int = 512,
        axis: str = "tensor",
        dtype=jnp.float32,
        causal: bool = True,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if norm not in ("layer", "rms"):
            raise PlanError(f"TransformerBlock(norm={norm!r}): expected 'layer' or 'rms'.")
        k1, k2 = jax.random.split(key)

        def make_norm():
            return (
                LayerNorm(d_model, use_bias=use_bias, dtype=dtype)
                if norm == "layer"
                else RMSNorm(d_model, dtype=dtype)
            )

        self.norm1 = make_norm()
        self.attn = Attention(
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            causal=causal,
            fused_qkv=fused_qkv,
            rotary=rotary,
            rotary_base=rotary_base,
            attention=attention,
            attention_block=attention_block,
            dropout=attention_dropout,
            use_bias=use_bias,
            axis=axis,
            dtype=dtype,
            key=k1,
        )
        self.norm2 = make_norm()
        self.mlp = MLP(
            d_model, d_hidden, activation=activation, use_bias=use_bias, axis=axis, dtype=dtype, key=k2
        )
        self.dropout = Dropout(dropout)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        segment_ids: Int[Array, "_batch _seq"] | None = None,
    ) -> Float[Array, "batch seq d_model"]:
        k1 = k2 = k_attn = None
        if key is not None and self.attn.dropout > 0:
            # Split off first: the residual dropout's keys stay what they were
            # without attention dropout.
            key, k_attn = jax.random.split(key)
        if key is not None and self.dropout.rate > 0:
            k1, k2 = jax.random.split(key)
        h = self.attn(self.norm1(x), segment_ids=segment_ids, key=k_attn)
        x = x + self.dropout(h, key=k1)
        return x + self.dropout(self.mlp(self.norm2(x)), key=k2)
