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

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .. import nn
from .._errors import SpecError
from ..nn._sequence import split_context, split_tensor_sequence


def chunked_token_losses(
    logits: Callable[[Array], Array],
    head: "nn.Unembed | nn.Embedding",
    h: Array,
    labels: Array,
    chunk: int,
) -> Array:
    """`nn.cross_entropy(logits(h), labels, head=head)`, computed `chunk` positions
    of `h` at a time.

    **Arguments:** `logits`: final norm and head, `(batch, n, d_model) -> (batch, n',
    vocab or its shard)`; `head`: the layer whose output that is; `h` `(batch, seq',
    d_model)`, this device's sequence (block); `labels` `(batch, seq)`, the whole
    label sequence; `chunk`: positions of `h` per chunk (the last chunk is padded
    and its padding dropped, so any `seq'` works).

    **Returns:** the float32 per-token losses, in the layout `nn.cross_entropy`
    returns for the unchunked logits.
    """
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
    def one(xs: tuple[Array, Array]) -> Array:
        h_chunk, labels_chunk = xs
        return nn.cross_entropy(logits(h_chunk), labels_chunk, head=head)

    losses = jax.lax.map(one, (hs, ls)).reshape(n, batch, blocks, chunk)
    losses = jnp.moveaxis(losses, 0, 2).reshape(batch, blocks, n * chunk)[:, :, :length]
    return losses.reshape(batch, blocks * length)
