"""Model FLOPs per token of a training step: the numerator of MFU.

Model FLOPs count what the model needs, not what a plan runs: recomputation
(remat), a pipeline's bubble and padding are left out, so that MFU compares plans
on the same work. A training step costs 3 times its forward pass (the backward
pass multiplies by each weight twice: once for the input's gradient, once for the
weight's), and a forward pass costs 2 FLOPs per weight a token meets in a matrix
multiply, hence `6 x matmul weights` per token. Attention adds what no weight
counts: the scores `q k^T` and their use `p v`.
"""

from .._errors import PlanError
from ._gpt import GPTConfig


def _positive_int(where: str, name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{where}({name}={value!r}): expected a positive integer.")
    return value


def transformer_flops_per_token(
    *,
    matmul_params: int,
    num_layers: int,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    causal: bool = True,
) -> int:
    """Training FLOPs per token (forward and backward) of a transformer described by
    its sizes: for models other than `GPT` (`flops_per_token` reads a `GPTConfig`).

    `6 x matmul_params + 12 x num_layers x seq_len x num_heads x head_dim`, the
    second term halved when `causal`. Per layer, each token's query meets `seq_len`
    keys (`q k^T`, `2 seq_len head_dim` FLOPs per head) and takes a weighted sum of
    as many values (`p v`, as much again): `4 seq_len heads head_dim` forward, 3 times
    that with the backward pass. A causal mask leaves each query half the keys on
    average, so that term is halved: the convention of MaxText's MFU (and of
    PaLM's), which counts only the attention a causal model needs, whether or not
    the kernel skips the masked half.

    **Arguments** (keyword-only):

    - `matmul_params`: weights a token meets in matrix multiplies: every projection
      and MLP weight, the output head's (tied or not); not the embedding lookup (a
      gather, no FLOPs), norms or biases. For mixture-of-experts layers, the router
      and the `top_k` experts a token goes to, not every expert.
    - `num_layers`, `seq_len`: attention layers and tokens per sequence.
    - `num_heads`, `head_dim`: query heads per layer and their width (grouped-query
      attention's fewer key/value heads change only `matmul_params`).
    - `causal`: halve the attention term (default True).

    **Returns:** FLOPs per token, an `int`.

    ```python
    eqxpar.models.transformer_flops_per_token(
        matmul_params=85_000_000, num_layers=12, seq_len=1024, num_heads=12, head_dim=64
    )  # 6 x 85M + 6 x 12 x 1024 x 12 x 64 = 0.57 GFLOP per token
    ```
    """
    where = "transformer_flops_per_token"
    for name, value in (
        ("matmul_params", matmul_params),
        ("num_layers", num_layers),
        ("seq_len", seq_len),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
    ):
        _positive_int(where, name, value)
    if not isinstance(causal, bool):
        raise PlanError(f"{where}(causal={causal!r}): expected True or False.")
    attention = 12 * num_layers * seq_len * num_heads * head_dim
    return 6 * matmul_params + (attention // 2 if causal else attention)


def _block_matmul_params(config: GPTConfig, *, moe: bool) -> int:
    """Weights one token meets in one block's matrix multiplies."""
    d, heads, head_dim = config.d_model, config.num_heads, config.head_dim
    kv_heads = config.num_kv_heads or heads
    # Q and the output projection are heads wide; K and V kv_heads wide
    # (grouped-query attention). A fused QKV weight has the same elements.
    attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim
    per_mlp = (3 if config.activation == "swiglu" else 2) * d * config.d_hidden
    if not moe:
        return attention + per_mlp
    # Each token runs its top_k experts and the shared ones; the router scores
    # every expert.
    return attention + d * config.experts + (config.top_k + config.num_shared_experts) * per_mlp


def flops_per_token(config: GPTConfig, *, seq_len: int | None = None, causal: bool = True) -> int:
    """Training FLOPs per token (forward and backward) of an `eqxpar.models.GPT`:
    the model FLOPs behind MFU (`eqxpar.train.Throughput`).

    `transformer_flops_per_token` of the config's matmul weights: per block the
    Q, K, V and output projections (K and V `num_kv_heads` wide), the MLP (3
    matrices for SwiGLU, 2 for GELU), for MoE blocks the router and `top_k` routed
    experts plus the shared ones; and the output head (`d_model x vocab_size`, a
    matmul also when tied to the embedding, whose lookup costs nothing). Plus the
    attention scores, halved for causal attention (MaxText's convention).

    Not counted: norms, activations, softmax, rotary embeddings and the loss
    (element-wise, a few percent at most), and what a plan adds: recomputation
    (remat) or a capacity factor's padding. `eqxpar.inspect.matmul_flops` of a
    compiled step counts what runs instead; for a single-device step of a dense
    model without remat the two agree with `causal=False` (a dense attention
    kernel computes the masked scores too).

    **Arguments:**

    - `config`: a `GPTConfig`.
    - `seq_len`: tokens per training sequence (default `config.max_seq_len`).
    - `causal`: halve the attention term (default True: `GPT` is causal).

    **Returns:** FLOPs per token, an `int`; times the tokens of a step, the step's
    model FLOPs.

    ```python
    config = eqxpar.models.GPTConfig(vocab_size=128, d_model=128, num_heads=4,
                                     num_layers=4, d_hidden=384)
    eqxpar.models.flops_per_token(config, seq_len=64)  # 6 x 802,816 + 6 x 4 x 64 x 128
    ```
    """
    if not isinstance(config, GPTConfig):
        raise PlanError(
            f"flops_per_token(config={config!r}): expected an eqxpar.models.GPTConfig; for another "
            "transformer use eqxpar.models.transformer_flops_per_token."
        )
    seq = config.max_seq_len if seq_len is None else _positive_int("flops_per_token", "seq_len", seq_len)
    if seq > config.max_seq_len:
        raise PlanError(
            f"flops_per_token(seq_len={seq}): longer than config.max_seq_len={config.max_seq_len}, the "
            "longest input the model takes. Pass the training sequence length."
        )
    moe_blocks = config.moe_layers
    params = (config.num_layers - moe_blocks) * _block_matmul_params(config, moe=False)
    params += moe_blocks * _block_matmul_params(config, moe=True)
    params += config.d_model * config.vocab_size  # the output head, tied or not
    return transformer_flops_per_token(
        matmul_params=params,
        num_layers=config.num_layers,
        seq_len=seq,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        causal=causal,
    )
