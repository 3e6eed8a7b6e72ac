"""The workload written with eqxpar.nn layers (Megatron: heads and MLP features split over
`tensor`, the rest replicated), for the tensor-parallel and 3D records; `convert` is a
pure re-layout of the workload's weights (or gradients).

Not `eqxpar.models.GPT`: its vocabulary-parallel embedding, head and cross-entropy add
tensor collectives this layout, the records' since they were first measured, lacks.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

import eqxpar
from eqxpar import nn

from . import _workload


class TPTransformer(eqx.Module):
    """Batch-first `_workload.Transformer` with `eqxpar.nn.TransformerBlock`s (fused QKV);
    returns this device's logits (the local sequence block under sequence parallelism).
    `blocks` is a list, or an `eqxpar.nn.Stacked` for pipelines."""

    embed: Float[Array, "vocab d_model"] = eqxpar.param(axes=(None, "embed"))
    positions: Float[Array, "seq d_model"] = eqxpar.param(axes=(None, "embed"))
    blocks: list[nn.TransformerBlock] | nn.Stacked
    ln_f: nn.LayerNorm
    head: Float[Array, "d_model vocab"] = eqxpar.param(axes=("embed", None))

    def __call__(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq_out vocab"]:
        # Split the ids and the position table, not the embedded activations: the
        # backward pass then sums table-sized gradients over `tensor`, not (B, S, D).
        ids = nn.split_sequence(tokens)
        positions = nn.split_sequence(self.positions[: tokens.shape[1]], seq_dim=0)
        x = jnp.take(self.embed, ids, axis=0) + positions[None]
        for block in self.blocks:
            x = block(x)
        return jnp.tensordot(self.ln_f(x), self.head, axes=1)


def loss_fn(model: TPTransformer, batch: _workload.Batch) -> Float[Array, ""]:
    """The workload's loss: next-token cross-entropy averaged over every token."""
    inputs, targets = batch
    per_token = optax.softmax_cross_entropy_with_integer_labels(model(inputs), nn.split_sequence(targets))
    return nn.sequence_mean(per_token)


def _block(b: _workload.Block) -> nn.TransformerBlock:
    d, h, mlp = b.qkv.weight.shape[1], b.heads, b.up.weight.shape[0]
    block = nn.TransformerBlock(d, h, mlp, fused_qkv=True, key=jax.random.key(0))
    # eqx.nn.Linear stores (out, in); the eqxpar layers store (in, ..., out).
    return eqx.tree_at(
        lambda t: (
            *(t.norm1.weight, t.norm1.bias, t.attn.wqkv, t.attn.bq, t.attn.bk, t.attn.bv, t.attn.wo),
            *(t.attn.bo, t.norm2.weight, t.norm2.bias, t.mlp.w_in, t.mlp.b_in, t.mlp.w_out, t.mlp.b_out),
        ),
        block,
        (
            *(b.ln1.weight, b.ln1.bias, b.qkv.weight.T.reshape(d, 3, h, d // h)),
            *b.qkv.bias.reshape(3, h, d // h),
            *(b.out.weight.T.reshape(h, d // h, d), b.out.bias, b.ln2.weight, b.ln2.bias),
            *(b.up.weight.T[:, None, :], b.up.bias[None, :], b.down.weight.T, b.down.bias),
        ),
    )


# Jitted: eagerly, building each block and moving each weight is an op (and a
# compile) apiece, and the harness converts models and gradients several times.
@eqx.filter_jit
def convert(model: _workload.Transformer) -> TPTransformer:
    """The same weights in `TPTransformer`'s layout; works on any pytree shaped like
    the workload model (its gradients, say): it only moves and reshapes arrays."""
    d = model.embed.weight.shape[1]
    ln_f = eqx.tree_at(lambda n: (n.weight, n.bias), nn.LayerNorm(d), (model.ln_f.weight, model.ln_f.bias))
    return TPTransformer(
        embed=model.embed.weight,
        positions=model.positions.weight,
        blocks=[_block(b) for b in model.blocks],
        ln_f=ln_f,
        head=model.head.weight.T,
    )
