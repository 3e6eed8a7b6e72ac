"""The workload as pipeline models (`convert`: its own blocks stacked, records `pp_*`;
`convert_tp`: `_tp_model`'s, record `3d`), and what the pipeline engine is designed to send."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

import eqxpar
from eqxpar import nn

from . import _tp_model, _workload


class Layer(eqx.Module):
    """A workload `Block` applied to every sequence of a micro-batch `(rows, seq, d)`."""

    block: _workload.Block

    def __call__(self, x: Float[Array, "rows seq d"]) -> Float[Array, "rows seq d"]:
        return jax.vmap(self.block)(x)


@eqx.filter_jit
def _stacked(blocks: list, stages: int, chunks: int) -> nn.Stacked:
    # One compiled program rather than an eager op (and its compile) per leaf.
    stack = nn.Stacked.from_blocks(blocks)
    return eqxpar.pipeline.to_pipeline_order(stack, stages=stages, chunks=chunks)


def convert(model: _workload.Transformer, *, stages: int = 1, chunks: int = 1) -> _workload.Transformer:
    """The workload with its blocks stacked in the pipeline order of `stages` x `chunks`.
    Only moves arrays, so it also maps the workload's gradients."""
    stack = _stacked([Layer(b) for b in model.blocks], stages, chunks)
    return eqx.tree_at(lambda m: m.blocks, model, stack)


def convert_tp(model: _workload.Transformer, *, stages: int = 1, chunks: int = 1) -> _tp_model.TPTransformer:
    """`_tp_model.convert(model)` with its blocks stacked in pipeline order."""
    tp = _tp_model.convert(model)
    return eqx.tree_at(lambda m: m.blocks, tp, _stacked(list(tp.blocks), stages, chunks))


def _first(model: Any, batch: _workload.Batch) -> Float[Array, "rows seq d"]:
    inputs, _ = batch
    if isinstance(model, _tp_model.TPTransformer):
        return jnp.take(model.embed, inputs, axis=0) + model.positions[: inputs.shape[1]][None]
    return model.embed.weight[inputs] + model.positions.weight[: inputs.shape[1]][None]


def _last(model: Any, h: Float[Array, "rows seq d"], batch: _workload.Batch) -> Float[Array, ""]:
    if isinstance(model, _tp_model.TPTransformer):
        logits = jnp.tensordot(model.ln_f(h), model.head, axes=1)
    else:
        logits = jax.vmap(jax.vmap(model.head))(jax.vmap(jax.vmap(model.ln_f))(h))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


#: The workload's loss in the three parts a pipeline runs, for both models.
LOSS = eqxpar.pipeline.PipelineLoss(_first, lambda m: m.blocks, _last)


def local_param_bytes(model: Any, plan: eqxpar.Plan) -> int:
    """Bytes of one device's share of `model`'s floating-point parameters under `plan`."""
    specs = jax.tree.leaves(
        eqxpar.partition_specs(model, plan), is_leaf=lambda s: isinstance(s, PartitionSpec)
    )
    params = jax.tree.leaves(
        eqx.filter(model, lambda x: jnp.issubdtype(getattr(x, "dtype", int), jnp.inexact))
    )

    def split(spec: PartitionSpec) -> int:
        axes = [
            a
            for entry in spec
            if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))
        ]
        return math.prod(plan.mesh.shape[a] for a in axes)

    pairs = zip(params, specs, strict=True)
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // split(s) for x, s in pairs)


def _ring_all_reduce(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


def designed_bytes(model: Any, plan: eqxpar.Plan, cfg: _workload.Config, ticks: int) -> tuple[int, int]:
    """(permute result bytes, wire bytes) the engine is designed to send per device per step.

    Every tick it sends one activation forward and one cotangent back along `pipe`
    (zeros when a device has nothing to send); then the data-axis all-reduce of all
    its gradients and the all-reduce over `pipe` of the non-stack gradients; with
    `tensor`, the stage body's activation all-reduces (a permute's wire bytes are its
    result bytes).
    """
    mesh = plan.mesh.shape
    p, t = mesh["pipe"], mesh.get("tensor", 1)
    dp = math.prod(mesh[a] for a in plan.batch_axes)
    total = local_param_bytes(model, plan)
    rest = local_param_bytes(eqx.tree_at(lambda m: m.blocks, model, None), plan)
    activation = cfg.batch // dp // plan.microbatches * cfg.seq_len * cfg.d_model * 4
    # Megatron layers sum attention and MLP outputs over `tensor` in the forward
    # pass and their input cotangents in the backward: 2 + 2 activation all-reduces
    # per layer and micro-batch; the engine's backward recomputes the stage forward
    # (it keeps only stage inputs): 2 more.
    layers = LOSS.stack(model).depth // p
    tensor = 6 * layers * plan.chunks * plan.microbatches if t > 1 else 0
    permute = ticks * 2 * activation if p > 1 else 0
    grads = _ring_all_reduce(total, dp) + _ring_all_reduce(rest, p)
    return permute, permute + grads + tensor * _ring_all_reduce(activation, t)
