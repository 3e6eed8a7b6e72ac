"""A hand-written sequence-parallel `jax.shard_map` step of the workload without eqxpar, the bar
`tp_sp` and `tp_overlap` are timed against (benchmarks/README.md)."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from eqxpar.models import GPT

from . import _workload
from ._measure import OwnStateStep, opt_specs, train_step

_BLOCK_SPECS = {
    **dict.fromkeys(("ln1_w", "ln1_b", "b_out", "ln2_w", "ln2_b", "b_down"), P()),
    "w_qkv": P(None, None, "tensor", None),  # (d, 3, heads, head_dim)
    "b_qkv": P(None, "tensor", None),
    "w_out": P("tensor", None, None),  # (heads, head_dim, d)
    **{"w_up": P(None, "tensor"), "b_up": P("tensor"), "w_down": P("tensor", None)},
}


def params_of(model: GPT) -> dict:
    """The workload's weights (or gradients) as a dict of arrays, one dict per block."""

    def block(b: Any) -> dict:
        attn, mlp = b.attn, b.mlp
        return {
            **{"ln1_w": b.norm1.weight, "ln1_b": b.norm1.bias, "w_qkv": attn.wqkv},
            **{"b_qkv": jnp.stack([attn.bq, attn.bk, attn.bv]), "w_out": attn.wo, "b_out": attn.bo},
            **{"ln2_w": b.norm2.weight, "ln2_b": b.norm2.bias, "w_up": mlp.w_in[:, 0], "b_up": mlp.b_in[0]},
            **{"w_down": mlp.w_out, "b_down": mlp.b_out},
        }

    return {
        **{"embed": model.embed.weight, "positions": model.positions, "head": model.head.weight},
        "blocks": [block(model.blocks[i]) for i in range(model.config.num_layers)],
        **{"lnf_w": model.final_norm.weight, "lnf_b": model.final_norm.bias},
    }


def _layer_norm(x: Array, w: Array, b: Array) -> Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * w + b


def _block(p: dict, x: Float[Array, "b s_local d"]) -> Float[Array, "b s_local d"]:
    h = lax.all_gather(_layer_norm(x, p["ln1_w"], p["ln1_b"]), "tensor", axis=1, tiled=True)
    qkv = jnp.einsum("bsd,dthe->bsthe", h, p["w_qkv"]) + p["b_qkv"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    seq, head_dim = h.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
    mixed = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v)
    attn = jnp.einsum("bqhe,hed->bqd", mixed, p["w_out"])
    x = x + lax.psum_scatter(attn, "tensor", scatter_dimension=1, tiled=True) + p["b_out"]
    h = lax.all_gather(_layer_norm(x, p["ln2_w"], p["ln2_b"]), "tensor", axis=1, tiled=True)
    up = jax.nn.gelu(h @ p["w_up"] + p["b_up"])
    return x + lax.psum_scatter(up @ p["w_down"], "tensor", scatter_dimension=1, tiled=True) + p["b_down"]


def _loss(params: dict, tokens: _workload.Batch) -> Float[Array, ""]:
    # This device's rows, the whole sequence: its sequence block of the ids and labels.
    i, block = lax.axis_index("tensor"), (tokens.shape[1] - 1) // lax.axis_size("tensor")
    ids, labels = (
        lax.dynamic_slice_in_dim(t, i * block, block, axis=1) for t in (tokens[:, :-1], tokens[:, 1:])
    )
    positions = lax.dynamic_slice_in_dim(params["positions"], i * block, block, axis=0)
    # Numpy broadcasting, as users write it (the tests run under rank_promotion="raise").
    with jax.numpy_rank_promotion("allow"):
        x = params["embed"][ids] + positions[None]
        for p in params["blocks"]:
            x = _block(p, x)
        logits = _layer_norm(x, params["lnf_w"], params["lnf_b"]) @ params["head"]
        local = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return lax.pmean(local, ("data", "tensor"))


class HandwrittenSP(OwnStateStep):
    """The step above with its own (donated) state, run like a `JitStep`, on `mesh`
    (axes `data` and `tensor`); `model` is copied, never donated."""

    def __init__(self, model: GPT, optim: optax.GradientTransformation, mesh: Mesh):
        params = params_of(model)
        # Megatron over `tensor`, else replicated.
        rest = {k: P() for k in ("embed", "positions", "lnf_w", "lnf_b", "head")}
        specs = {**rest, "blocks": [dict(_BLOCK_SPECS) for _ in params["blocks"]]}
        state_specs = opt_specs(optim, params, specs)
        in_specs, out_specs = (specs, state_specs, P("data")), (specs, state_specs, P())
        step = jax.shard_map(
            train_step(_loss, optim), mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True
        )
        super().__init__(step, optim, params, mesh, specs, state_specs, P("data"))
