"""A pre-norm transformer block made of the tensor-parallel layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._errors import PlanError
from ._attention import Attention
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
    `axis="tensor"`, `dtype`, `key`.

    Input and output `(batch, seq, d_model)` (the local sequence block under
    sequence parallelism in manual mode).

    ```python
    block = eqxpar.nn.TransformerBlock(256, 8, 1024, activation="swiglu", norm="rms",
                                       rotary=True, key=key)
    y = block(x)                            # x: (batch, seq, 256)
    ```
    """

    norm1: LayerNorm | RMSNorm
    attn: Attention
    norm2: LayerNorm | RMSNorm
    mlp: MLP

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
            fused_qkv=fused_qkv,
            rotary=rotary,
            rotary_base=rotary_base,
            attention=attention,
            attention_block=attention_block,
            use_bias=use_bias,
            axis=axis,
            dtype=dtype,
            key=k1,
        )
        self.norm2 = make_norm()
        self.mlp = MLP(
            d_model, d_hidden, activation=activation, use_bias=use_bias, axis=axis, dtype=dtype, key=k2
        )

    def __call__(self, x: Float[Array, "batch seq d_model"]) -> Float[Array, "batch seq d_model"]:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
