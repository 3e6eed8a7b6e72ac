"""The benchmark workload (benchmarks/README.md) in plain Equinox, on purpose without
eqxpar code: every strategy must handle an ordinary model."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

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


CONFIG = Config()


class Block(eqx.Module):
    """Pre-LayerNorm decoder block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, cfg: Config, *, key: PRNGKeyArray):
        k_qkv, k_out, k_up, k_down = jax.random.split(key, 4)
        self.ln1 = eqx.nn.LayerNorm(cfg.d_model)
        self.qkv = eqx.nn.Linear(cfg.d_model, 3 * cfg.d_model, key=k_qkv)
        self.out = eqx.nn.Linear(cfg.d_model, cfg.d_model, key=k_out)
        self.ln2 = eqx.nn.LayerNorm(cfg.d_model)
        self.up = eqx.nn.Linear(cfg.d_model, cfg.mlp, key=k_up)
        self.down = eqx.nn.Linear(cfg.mlp, cfg.d_model, key=k_down)
        self.heads = cfg.heads

    def attention(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        seq, d = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        q, k, v = (t.reshape(seq, self.heads, d // self.heads) for t in (q, k, v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal[None, :, :], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        mixed = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, d)
        return jax.vmap(self.out)(mixed)

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        x = x + self.attention(jax.vmap(self.ln1)(x))
        h = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x)))
        return x + jax.vmap(self.down)(h)


class Transformer(eqx.Module):
    """Decoder-only language model over one sequence: tokens (seq,) -> logits (seq, vocab)."""

    embed: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, cfg: Config, *, key: PRNGKeyArray):
        k_embed, k_pos, k_head, *k_blocks = jax.random.split(key, 3 + cfg.layers)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.d_model, key=k_embed)
        self.positions = eqx.nn.Embedding(cfg.seq_len, cfg.d_model, key=k_pos)
        self.blocks = [Block(cfg, key=k) for k in k_blocks]
        self.ln_f = eqx.nn.LayerNorm(cfg.d_model)
        self.head = eqx.nn.Linear(cfg.d_model, cfg.vocab, use_bias=False, key=k_head)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = self.embed.weight[tokens] + self.positions.weight[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def param_count(model: eqx.Module) -> int:
    """Number of floating-point parameters of `model` (arrays or `jax.eval_shape` outlines)."""
    leaves = jax.tree.leaves(model)
    return sum(x.size for x in leaves if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact))


def make_model(cfg: Config = CONFIG, *, key: PRNGKeyArray | None = None) -> Transformer:
    """The workload's model from a fixed key."""
    return Transformer(cfg, key=jax.random.key(0) if key is None else key)


Batch = tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]


def loss_fn(model: Transformer, batch: Batch) -> Float[Array, ""]:
    """Next-token cross-entropy, averaged over sequences and positions."""
    inputs, targets = batch
    logits = jax.vmap(model)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_batches(n: int, cfg: Config = CONFIG) -> list[Batch]:
    """`n` deterministic synthetic batches (inputs, next-token targets)."""
    keys = (jax.random.fold_in(jax.random.key(1), i) for i in range(n))
    tokens = [jax.random.randint(k, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab) for k in keys]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


#: AdamW's first-moment decay, named: the harness reads the first step's gradients
#: back from the first moment (`_measure.adam_gradients`).
ADAM_B1 = 0.9


def make_optimizer(cfg: Config = CONFIG) -> optax.GradientTransformation:
    return optax.adamw(cfg.learning_rate, b1=ADAM_B1, weight_decay=cfg.weight_decay)


def describe(cfg: Config = CONFIG) -> dict:
    """The workload's sizes, recorded beside every result."""
    return {**dataclasses.asdict(cfg), "param_count": param_count(eqx.filter_eval_shape(make_model, cfg))}
