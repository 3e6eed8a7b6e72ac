"""The output head and cross-entropy run over the sequence in chunks
(`GPTConfig(loss_chunk=...)`), so the logits never exist whole.

For a large vocabulary the float32 logits `(batch, seq, vocab)` and their gradient
are the largest temporaries of a train step (Llama 3's 128,256 columns: 1 GiB per
2048 tokens each). Here the head's matmul, the float32 log-softmax and the target
pick run on `chunk` positions at a time inside `lax.map`, whose body is
rematerialised: the forward pass keeps only the per-token losses, and the backward
pass recomputes one chunk's logits at a time. The cost is the head's matmul run
once more (in the backward pass), a few percent of a step's FLOPs.

The per-token losses come back in the layout the unchunked head gives, so the
GPT reduces them exactly as it does without chunks (and under every plan).
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array

from .. import nn
from .._errors import SpecError
from .._parallel_dims import ParallelDims
from .._plan import current_plan
from .._shard_map import filter_shard_map
from .._varying import mark_varying, varying_axes
from ..nn._sequence import split_context, split_tensor_sequence


def chunked_token_losses(
    logits: Callable[[Any, Array], Array],
    layers: tuple[Any, "nn.Unembed | nn.Embedding"],
    h: Array,
    labels: Array,
    chunk: int,
) -> Array:
    """`nn.cross_entropy(logits(layers, h), labels, head=layers[-1])`, computed
    `chunk` positions of `h` at a time.

    **Arguments:** `logits`: `(layers, x) -> logits`, final norm and head, `(batch,
    n, d_model) -> (batch, n', vocab or its shard)`; `layers`: the modules it runs,
    the last the head (the layer whose output the logits are); `h` `(batch, seq',
    d_model)`, this device's sequence (block); `labels` `(batch, seq)`, the whole
    label sequence; `chunk`: positions of `h` per chunk (the last chunk is padded
    and its padding dropped, so any `seq'` works).

    **Returns:** the float32 per-token losses, in the layout `nn.cross_entropy`
    returns for the unchunked logits.
    """
    head = layers[-1]
    ctx = nn.tensor_context(head.axis)
    # The labels of this device's tokens: its part of the context split; under
    # sequence parallelism in manual mode a vocabulary-split head gathers the
    # sequence blocks of all `blocks` devices of the axis (chunk i of each), a
    # whole-vocabulary head scores only this device's block.
    labels = split_context(labels)
    gathers = ctx.manual and ctx.sequence_parallel
    blocks = ctx.size if gathers and head.vocab_split() else 1
    if gathers and blocks == 1:
        labels = split_tensor_sequence(labels, axis=head.axis)
    batch, length, width = h.shape
    if labels.shape != (batch, blocks * length):
        raise SpecError(
            f"GPTConfig(loss_chunk={chunk}): activations of shape {h.shape} do not match labels of "
            f"shape {labels.shape} (expected {(batch, blocks * length)} here). Pass the tokens whose "
            "first seq positions produced the activations."
        )
    n = -(-length // chunk)
    pad = n * chunk - length
    # Zero activations in the padding: finite logits, whose losses are dropped below
    # (so their gradient is zero); label 0 is a valid id on every device.
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(labels.reshape(batch, blocks, length), ((0, 0), (0, 0), (0, pad)))
    hs = jnp.moveaxis(h.reshape(batch, n, chunk, width), 1, 0)
    ls = jnp.moveaxis(labels.reshape(batch, blocks, n, chunk), 2, 0).reshape(n, batch, blocks * chunk)

    # Saving nothing of a chunk: its logits are recomputed in the backward pass.
    @jax.checkpoint
    def one(layers: Any, xs: tuple[Array, Array]) -> Array:
        h_chunk, labels_chunk = xs
        return nn.cross_entropy(logits(layers, h_chunk), labels_chunk, head=layers[-1])

    losses = _map_chunks(one, layers, hs, ls, head.axis).reshape(n, batch, blocks, chunk)
    losses = jnp.moveaxis(losses, 0, 2).reshape(batch, blocks, n * chunk)[:, :, :length]
    return losses.reshape(batch, blocks * length)


def _map_chunks(
    one: Callable[[Any, tuple[Array, Array]], Array], layers: Any, hs: Array, ls: Array, axis: str
) -> Array:
    """`one(layers, (h, labels))` of every chunk, stacked.

    In automatic mode under a plan the loop runs per batch shard (a `shard_map`
    over the plan's batch axes, the tensor `axis` left automatic): the weights are
    gathered once as it starts and their gradient summed over the shards once as
    it ends. Left to the compiler, a loop over a batch-split activation gathers
    the head's weight in every chunk and all-reduces its gradient in every chunk.
    In a manual region (a manual step, a pipeline, context parallelism) each
    device runs its own shard already."""

    def run(layers: Any, hs: Array, ls: Array) -> Array:
        # The weights typed as varying where the activations do, once, before the
        # loop: JAX would cast them inside its body, and the cast's transpose (a
        # psum of the weights' gradient) would run in every chunk.
        varying = varying_axes(hs) | varying_axes(ls)
        layers = jax.tree.map(lambda x: _varying(x, varying) if eqx.is_array(x) else x, layers)
        return jax.lax.map(lambda xs: one(layers, xs), (hs, ls))

    plan = current_plan()
    if plan is None or jax.sharding.get_abstract_mesh().manual_axes:
        return run(layers, hs, ls)
    axes = tuple(a for a in ParallelDims.of(plan).batch_axes if a != axis and plan.mesh.shape[a] > 1)
    shards = math.prod(plan.mesh.shape[a] for a in axes)
    if not axes or hs.shape[1] % shards:
        return run(layers, hs, ls)
    rows = PartitionSpec(None, axes)
    region = filter_shard_map(
        run, plan, in_specs=(PartitionSpec(), rows, rows), out_specs=rows, axis_names=axes
    )
    return region(layers, hs, ls)


def _varying(x: Array, axes: frozenset[str]) -> Array:
    """`x` marked varying along `axes`. The mark's transpose sums the gradient over
    them: in at least float32, the parameters' dtype under `Plan(compute_dtype=)`
    (XLA:CPU also fails to compile that sum in bfloat16)."""
    if not axes - varying_axes(x):
        return x
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return mark_varying(x.astype(wide), axes).astype(x.dtype)
