"""The fixed benchmark workload of /work/shared/ANCHORS.md, in plain Equinox.

Decoder-only transformer (vocab 512, d_model 256, 4 layers, 4 heads of 64, MLP 1024
with GELU, sequence 128, pre-LayerNorm, learned positions, untied head without bias,
causal mask), 3,454,464 float32 parameters; global batch 32; AdamW(1e-3, wd 0.01).
It uses no eqxpar layer on purpose: every strategy must handle an ordinary model,
and the numbers must sit next to those ANCHORS.md measured on the same model.
"""

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
    """Sizes and optimizer settings of the workload (one fixed instance: `CONFIG`)."""

    vocab: int = 512
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    mlp: int = 1024
    seq_len: int = 128
    batch: int = 32
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


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
    """Number of scalar parameters (floating array elements) in `model`, or in its `jax.eval_shape`."""
    leaves = jax.tree.leaves(model)
    return sum(x.size for x in leaves if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact))


def make_model(cfg: Config = CONFIG, *, key: PRNGKeyArray | None = None) -> Transformer:
    """The workload's model from a fixed key; checks the parameter count of ANCHORS.md."""
    model = Transformer(cfg, key=jax.random.key(0) if key is None else key)
    if cfg == CONFIG:
        count = param_count(model)
        # The anchors' numbers are only comparable on exactly this model.
        if count != PARAM_COUNT:
            raise AssertionError(f"workload has {count} parameters, ANCHORS.md says {PARAM_COUNT}")
    return model


Batch = tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]


def loss_fn(model: Transformer, batch: Batch) -> Float[Array, ""]:
    """Next-token cross-entropy, averaged over sequences and positions."""
    inputs, targets = batch
    logits = jax.vmap(model)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_batches(n: int, cfg: Config = CONFIG, *, key: PRNGKeyArray | None = None) -> list[Batch]:
    """`n` deterministic synthetic batches (inputs, next-token targets), on the host's default device."""
    key = jax.random.key(1) if key is None else key
    batches = []
    for i in range(n):
        tokens = jax.random.randint(jax.random.fold_in(key, i), (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


#: AdamW's first-moment decay (optax's default, named: the harness reads the first
#: step's gradients back from the first moment, `_measure.adam_gradients`).
ADAM_B1 = 0.9


def make_optimizer(cfg: Config = CONFIG) -> optax.GradientTransformation:
    """AdamW as ANCHORS.md specifies."""
    return optax.adamw(cfg.learning_rate, b1=ADAM_B1, weight_decay=cfg.weight_decay)


def describe(cfg: Config = CONFIG) -> dict:
    """The workload as a JSON-ready dict (recorded beside every result)."""
    return {
        "model": "decoder-only transformer, pre-LayerNorm, learned positions, untied head (no bias), causal",
        "vocab": cfg.vocab,
        "d_model": cfg.d_model,
        "layers": cfg.layers,
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "mlp": cfg.mlp,
        "activation": "gelu (tanh approximation, jax.nn.gelu default)",
        "seq_len": cfg.seq_len,
        "global_batch": cfg.batch,
        "optimizer": f"adamw(lr={cfg.learning_rate}, weight_decay={cfg.weight_decay})",
        "dtype": cfg.dtype,
        "param_count": PARAM_COUNT,
        "param_bytes": PARAM_COUNT * jnp.dtype(cfg.dtype).itemsize,
    }
