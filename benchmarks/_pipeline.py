"""The workload as pipeline models, and what a pipeline step is designed to move.

Two models, each the same function as a plain-Equinox workload model at the same
weights (tested in `tests/test_benchmarks_harness.py`), so parity is measured
against the ordinary model on one device:

- `PipeTransformer` (`convert`): the workload's own `Block`s stacked into an
  `eqxpar.nn.Stacked`, embedding and head replicated; for `pp_*` on pipe 4 x data 2.
  Interleaving 4 stages x 2 chunks needs a depth divisible by 8, so the `pp_*`
  records run `PP_CONFIG`, the workload with 8 layers (same widths).
- `TPPipeTransformer` (`convert_tp`): the `eqxpar.nn` layers of `_tp_model` (Megatron
  tensor parallelism inside each stage) stacked; for `3d` on pipe 2 x data 2 x
  tensor 2 with the 4-layer workload.

The engine (`eqxpar/pipeline/_engine.py`) sends one activation forward and one
cotangent back along `pipe` every tick, zeros when a device has nothing to send;
`designed_bytes` counts that. What the schedule's boundaries must carry at least is
the library's minimum (`eqxpar.inspect.minimum_comm`).
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

import eqxpar
from eqxpar import nn

from . import _tp_model, _workload

#: The `pp_*` workload: ANCHORS' model with 8 layers, so that 4 stages x 2 chunks divide it.
PP_CONFIG = dataclasses.replace(_workload.CONFIG, layers=8)


class Layer(eqx.Module):
    """A workload `Block` applied to every sequence of a micro-batch `(rows, seq, d)`."""

    block: _workload.Block

    def __call__(self, x: Float[Array, "rows seq d"]) -> Float[Array, "rows seq d"]:
        return jax.vmap(self.block)(x)


class PipeTransformer(eqx.Module):
    """`_workload.Transformer` with its blocks in an `eqxpar.nn.Stacked` (no eqxpar layer otherwise)."""

    embed: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: nn.Stacked
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear


def _first(model: PipeTransformer, batch: _workload.Batch) -> Float[Array, "rows seq d"]:
    inputs, _ = batch
    return model.embed.weight[inputs] + model.positions.weight[: inputs.shape[1]][None]


def _last(model: PipeTransformer, h: Float[Array, "rows seq d"], batch: _workload.Batch) -> Float[Array, ""]:
    _, targets = batch
    logits = jax.vmap(jax.vmap(model.head))(jax.vmap(jax.vmap(model.ln_f))(h))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


#: The workload's loss in the three parts a pipeline runs (mean over the micro-batch's tokens).
LOSS = eqxpar.pipeline.PipelineLoss(_first, lambda m: m.blocks, _last)


@eqx.filter_jit
def _stacked(blocks: list, stages: int, chunks: int) -> nn.Stacked:
    # One compiled program rather than an eager op (and its compile) per leaf: the
    # runner converts models and gradients several times per record.
    stack = nn.Stacked.from_blocks(blocks)
    return eqxpar.pipeline.to_pipeline_order(stack, stages=stages, chunks=chunks)


def convert(model: _workload.Transformer, *, stages: int = 1, chunks: int = 1) -> PipeTransformer:
    """The same weights as a `PipeTransformer`, its stack in the pipeline order of
    `stages` x `chunks` (sequential order for one chunk). Only moves arrays, so it
    also maps the workload's gradients."""
    return PipeTransformer(
        embed=model.embed,
        positions=model.positions,
        blocks=_stacked([Layer(b) for b in model.blocks], stages, chunks),
        ln_f=model.ln_f,
        head=model.head,
    )


class TPPipeTransformer(eqx.Module):
    """`_tp_model.TPTransformer` with its `eqxpar.nn.TransformerBlock`s in a `Stacked`."""

    embed: Float[Array, "vocab d_model"] = eqxpar.param(axes=(None, "embed"))
    positions: Float[Array, "seq d_model"] = eqxpar.param(axes=(None, "embed"))
    blocks: nn.Stacked
    ln_f: nn.LayerNorm
    head: Float[Array, "d_model vocab"] = eqxpar.param(axes=("embed", None))


def _tp_first(model: TPPipeTransformer, batch: _workload.Batch) -> Float[Array, "rows seq d"]:
    inputs, _ = batch
    return jnp.take(model.embed, inputs, axis=0) + model.positions[: inputs.shape[1]][None]


def _tp_last(
    model: TPPipeTransformer, h: Float[Array, "rows seq d"], batch: _workload.Batch
) -> Float[Array, ""]:
    _, targets = batch
    logits = jnp.tensordot(model.ln_f(h), model.head, axes=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


#: `LOSS` for `TPPipeTransformer`.
TP_LOSS = eqxpar.pipeline.PipelineLoss(_tp_first, lambda m: m.blocks, _tp_last)


def convert_tp(
    model: _workload.Transformer,
    *,
    stages: int = 1,
    chunks: int = 1,
    cfg: _workload.Config = _workload.CONFIG,
) -> TPPipeTransformer:
    """The same weights as a `TPPipeTransformer` (via `_tp_model.convert` with the
    workload `cfg`), stack in pipeline order."""
    tp = _tp_model.convert(model, cfg)
    return TPPipeTransformer(
        embed=tp.embed,
        positions=tp.positions,
        blocks=_stacked(list(tp.blocks), stages, chunks),
        ln_f=tp.ln_f,
        head=tp.head,
    )


# --- Communication: what the engine is designed to send ------------------------------


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Per device per step, by part; `wire` in ring bytes (a collective-permute's
    wire bytes are its result bytes)."""

    permute: int  # activations forward + cotangents back (collective-permute)
    stage_grads: int  # data-axis all-reduce of this device's stack gradients (result bytes)
    rest_grads: int  # the embedding / head gradients (result bytes)
    tensor: int  # tensor-parallel activation all-reduces inside the stage body (result bytes)
    result: int
    wire: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _traffic(s: "Shapes", permute: int, tensor_all_reduces: int, result: int, wire: int) -> Traffic:
    # The designed traffic by part.
    return Traffic(
        permute=permute,
        stage_grads=s.stage_param_bytes if s.dp > 1 else 0,
        rest_grads=s.rest_param_bytes,
        tensor=tensor_all_reduces * s.activation_bytes,
        result=result,
        wire=wire,
    )


def _ring_all_reduce(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n if n > 1 else 0


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes the pipeline traffic depends on, per device."""

    stages: int  # p, the size of `pipe`
    chunks: int  # v
    microbatches: int  # m
    dp: int  # data-parallel devices
    tensor: int  # tensor-parallel devices
    activation_bytes: int  # one micro-batch's stage input on one device
    stage_param_bytes: int  # this device's share of the stack's parameters
    rest_param_bytes: int  # this device's share of everything outside the stack
    layers_per_device: int


def shapes(model: Any, plan: eqxpar.Plan, cfg: _workload.Config, loss: Any) -> Shapes:
    """`Shapes` of `model` (a converted pipeline model) under pipeline `plan`."""
    from ._strategies import local_param_bytes

    mesh = plan.mesh.shape
    p, v, m = mesh["pipe"], plan.chunks, plan.microbatches
    dp = math.prod(mesh[a] for a in plan.batch_axes)
    stack = loss.stack(model)
    rest = eqx.tree_at(lambda mod: mod.blocks, model, None)
    total = local_param_bytes(model, plan)
    stage_bytes = total - local_param_bytes(rest, plan)
    rows = cfg.batch // dp // m
    return Shapes(
        stages=p,
        chunks=v,
        microbatches=m,
        dp=dp,
        tensor=mesh.get("tensor", 1),
        activation_bytes=rows * cfg.seq_len * cfg.d_model * 4,
        stage_param_bytes=stage_bytes,
        rest_param_bytes=total - stage_bytes,
        layers_per_device=stack.depth // p,
    )


def _tensor_all_reduces(s: Shapes) -> int:
    # Megatron layers sum the attention and the MLP outputs over `tensor` in the
    # forward pass, and their input cotangents in the backward pass: 2 + 2
    # activation all-reduces per layer and micro-batch. The engine's backward also
    # recomputes the stage forward (it keeps only stage inputs): 2 more.
    if s.tensor == 1:
        return 0
    return 6 * s.layers_per_device * s.chunks * s.microbatches


def designed_bytes(s: Shapes, ticks: int) -> Traffic:
    """What the engine is designed to send per device per step: `ticks` x 2
    micro-batch activations (collective-permute), the data-axis all-reduce of all
    its gradients, the all-reduce over `pipe` of the non-stack gradients and, with
    `tensor`, the stage body's activation all-reduces of the micro-batches this
    device's busiest column runs (forward, recomputed forward, backward)."""
    permute = ticks * 2 * s.activation_bytes if s.stages > 1 else 0
    grads = s.stage_param_bytes + s.rest_param_bytes
    tensor = _tensor_all_reduces(s)
    result = (
        permute
        + (grads if s.dp > 1 else 0)
        + (s.rest_param_bytes if s.stages > 1 else 0)
        + tensor * s.activation_bytes
    )
    wire = (
        permute
        + _ring_all_reduce(grads, s.dp)
        + _ring_all_reduce(s.rest_param_bytes, s.stages)
        + tensor * _ring_all_reduce(s.activation_bytes, s.tensor)
    )
    return _traffic(s, permute, tensor, result, wire)


def formula_text(s: Shapes, ticks: int) -> str:
    """The designed-bytes formula with its numbers, for the JSON."""
    parts = [f"{ticks} ticks x 2 x {s.activation_bytes} B activation (collective-permute)"]
    if s.dp > 1:
        parts.append(
            f"all-reduce over data ({s.dp}) of {s.stage_param_bytes} B stage + {s.rest_param_bytes} B "
            "non-stack gradients"
        )
    if s.stages > 1:
        parts.append(f"all-reduce over pipe ({s.stages}) of the {s.rest_param_bytes} B non-stack gradients")
    if s.tensor > 1:
        parts.append(
            f"6 x {s.layers_per_device * s.chunks} layers x {s.microbatches} micro-batches activation "
            f"all-reduces over tensor ({s.tensor}) (forward, recomputed forward, backward)"
        )
    return " + ".join(parts)
