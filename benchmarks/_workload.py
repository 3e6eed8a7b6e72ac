"""The benchmark workload, `eqxpar.models.GPT` configured GPT-2 style (benchmarks/README.md)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray

import eqxpar
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss

#: embed 131072 + positions 32768 + 4 x 789760 + final LayerNorm 512 + head 131072.
PARAM_COUNT = 3_454_464


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and optimizer settings; `CONFIG` is the workload, others are its variants."""

    vocab: int = 512
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    mlp: int = 1024
    seq_len: int = 128
    batch: int = 32
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    #: Mixture of experts (the `ep` records): every `moe_every`-th block, `top_k` of `experts`. 0: dense.
    moe_every: int = 0
    experts: int = 0
    top_k: int = 2
    #: Llama style (`*_llama`): Q/K/V with `kv_heads` K/V heads, SwiGLU, RMSNorm, rotary, no biases, `tied`.
    llama: bool = False
    kv_heads: int = 0
    tied: bool = False
    unroll: int = 1  #: blocks per iteration of the stack's scan (4: unrolled, as `_handwritten_sp.py`)


CONFIG = Config()


def gpt_config(cfg: Config = CONFIG) -> GPTConfig:
    """GPT-2 style: learned positions, fused QKV with biases, LayerNorm, GELU, untied head, dense."""
    sizes = dict(vocab_size=cfg.vocab, d_model=cfg.d_model, num_heads=cfg.heads, num_layers=cfg.layers)
    sizes |= dict(d_hidden=cfg.mlp, max_seq_len=cfg.seq_len, moe_every=cfg.moe_every, experts=cfg.experts)
    style = dict(activation="gelu", norm="layer", tied=False, rotary=False, learned_positions=True)
    style |= dict(use_bias=True, fused_qkv=True)
    if cfg.llama:
        style = dict(
            activation="swiglu", norm="rms", tied=cfg.tied, use_bias=False, num_kv_heads=cfg.kv_heads
        )
    return GPTConfig(**sizes, **style, attention="dense", top_k=cfg.top_k, unroll=cfg.unroll)


def make_model(cfg: Config = CONFIG, *, key: PRNGKeyArray | None = None) -> GPT:
    """The workload's model from a fixed key."""
    # Jitted: one compiled program rather than an eager op (and compile) per weight.
    return eqx.filter_jit(GPT)(gpt_config(cfg), key=jax.random.key(0) if key is None else key)


def param_count(model: eqx.Module) -> int:
    """Number of floating-point parameters of `model` (arrays or `jax.eval_shape` outlines)."""
    leaves = jax.tree.leaves(model)
    return sum(x.size for x in leaves if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact))


#: One batch: `(batch, seq_len + 1)` token ids; each predicts the next.
Batch = Int[Array, "batch seq_plus_1"]
#: Next-token cross-entropy averaged over every predicted token.
loss_fn = lm_loss
#: The same loss in the three parts a pipeline runs.
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)

#: Megatron tensor parallelism with the vocabulary whole (512 ids: splitting costs more than it saves).
TENSOR_RULES = eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"})


def _experts_only(leaf: eqxpar.rules.Leaf) -> P | None:
    # MoE blocks' stacked experts over `expert` alone (`TENSOR_RULES` would split their "mlp").
    if leaf.axes is None or "experts" not in leaf.axes:
        return None
    return P(*("expert" if a == "experts" else None for a in leaf.axes))


#: Expert parallelism beside tensor parallelism: the experts over `expert`, the rest as `TENSOR_RULES`.
EXPERT_TENSOR_RULES = (eqxpar.rules.Policy(_experts_only), TENSOR_RULES)
#: `TENSOR_RULES` with the vocabulary split too: the 3D record (else its last stage runs the whole head).
TENSOR_VOCAB_RULES = eqxpar.rules.Logical({**dict(TENSOR_RULES.mapping), "vocab": "tensor"})
#: `TENSOR_RULES` plus the model dimension of every weight split over `fsdp`.
TENSOR_FSDP_RULES = eqxpar.rules.Logical({**dict(TENSOR_RULES.mapping), "embed": "fsdp"})


def make_batches(n: int, cfg: Config = CONFIG) -> list[Batch]:
    """`n` deterministic synthetic batches."""
    keys = (jax.random.fold_in(jax.random.key(1), i) for i in range(n))
    return [jax.random.randint(k, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab) for k in keys]


#: AdamW's first-moment decay: the harness reads the first gradients from it (`_measure.adam_gradients`).
ADAM_B1 = 0.9


def make_optimizer(cfg: Config = CONFIG) -> optax.GradientTransformation:
    return optax.adamw(cfg.learning_rate, b1=ADAM_B1, weight_decay=cfg.weight_decay)


def describe(cfg: Config = CONFIG) -> dict:
    """The workload's sizes, recorded beside every result."""
    return {**dataclasses.asdict(cfg), "param_count": param_count(eqx.filter_eval_shape(make_model, cfg))}
