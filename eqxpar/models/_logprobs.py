"""`token_logprobs`: each position's log-probability of the next token, through
the same head and (chunked) cross-entropy as `lm_loss`, so it never holds more
than a chunk of float32 logits and works under every plan `lm_loss` does."""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from .._errors import PlanError
from ..nn._sequence import whole_sequence
from ._gpt import GPT, _LossInputs, _run_blocks, output_head, token_losses


def token_logprobs(
    # Any: checked below, with an eqxpar error that names the type.
    model: Any,
    tokens: Int[Array, "batch seq_plus_1"],
    *,
    # Shaped, with dimensions of their own: checked below (as lm_loss's), with an
    # eqxpar error that names the argument.
    segment_ids: Shaped[Array, "_batch _seq_plus_1"] | None = None,
    positions: Shaped[Array, "_batch _seq_plus_1"] | None = None,
    # Any: checked below, with an eqxpar error that names the value.
    chunk: Any = None,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "batch seq"]:
    """The log-probability the model gives each next token: entry `[b, t]` is
    `log p(tokens[b, t + 1] | tokens[b, :t + 1])`, in float32, differentiable.

    It is minus `lm_loss`'s per-token cross-entropy, computed the same way: through
    the vocabulary-parallel head without gathering the vocabulary (the log-softmax's
    maximum, sum and the target's logit are reduced over the tensor axis as one
    number per token), and with `chunk` set, the final norm, the head and the
    float32 log-softmax run on `chunk` sequence positions at a time in a
    rematerialised loop, so neither the forward nor the backward pass holds more
    than one chunk's float32 logits (`batch x chunk x vocab`, or its vocabulary
    shard per device; under sequence parallelism in manual mode a chunk of each
    device's block, `blocks x chunk` rows of `vocab / blocks` columns). The
    `(batch, seq, vocab)` float32 tensor never exists.

    Under every plan of `eqxpar.train.make_step` (data, FSDP, tensor and sequence
    parallel, context parallel, expert parallel) the result is the whole
    sequence of this call's rows, the same on every device that shares them
    (under context parallelism, or a whole-vocabulary head under sequence
    parallelism, each device's part is written into place and summed: `batch x
    seq` float32 numbers), so a loss may combine a row's entries freely (a sum
    over its tokens, a preference loss of two rows). Not a pipeline piece: it
    runs the whole model (in a pipeline the last stage's loss sees only the
    blocks' output).

    **Arguments:**

    - `model`: a `GPT`.
    - `tokens`: `(batch, seq + 1)` integer ids; `seq + 1 >= 2`.
    - `segment_ids`: `(batch, seq + 1)` integers aligned with `tokens`, or None:
      documents packed in a row, each token attending only to earlier tokens of
      its own segment (as `lm_loss` takes them). The entry of a position whose
      next token starts another segment is a prediction across the boundary:
      leave it out of a loss (`segment_ids[:, 1:] == segment_ids[:, :-1]` says
      which are not).
    - `positions`: `(batch, seq + 1)` integer positions aligned with `tokens` (each
      document's restarting at 0), or None: the index in the row.
    - `chunk`: sequence positions of logits computed at a time, a positive integer,
      or None: the model's `GPTConfig.loss_chunk` (None there too: all at once).
    - `key`: for the LoRA adapters' dropout (as `lm_loss`'s), or None.

    **Returns:** float32 `(batch, seq)`, every entry `<= 0`.

    **Raises:** `PlanError` for a `chunk` that is not a positive integer, or a model
    that is not a `GPT`; `BatchError` for tokens shorter than 2 positions, not
    integers, or `segment_ids` / `positions` of another shape (as `lm_loss`).

    ```python
    logp = eqxpar.models.token_logprobs(model, tokens, chunk=512)   # (batch, seq)
    sequence_logp = jnp.sum(logp * mask, axis=1)
    ```
    """
    if not isinstance(model, GPT):
        raise PlanError(
            f"token_logprobs(model={type(model).__name__}): expected an eqxpar.models.GPT (its head "
            "and cross-entropy give the log-probabilities)."
        )
    chunk = _resolved_chunk(chunk, model.config.loss_chunk)
    # The checks and the model's inputs of lm_loss: the same shapes, dtypes and positions.
    loss_inputs = _LossInputs.of(
        model, tokens, "token_logprobs", segment_ids=segment_ids, positions=positions
    )
    ids, kw = loss_inputs.inputs()
    h, _ = _run_blocks(model, model.embed_tokens(ids, positions=kw.get("positions")), key, kw)
    losses = token_losses(model, h, loss_inputs.tokens[:, 1:], chunk)
    # A whole-vocabulary head under sequence parallelism scores this device's block
    # only; every head scores this device's part of a context-split sequence.
    head = output_head(model)
    whole = whole_sequence(losses, axis=head.axis, tensor_blocks=not head.vocab_split())
    return -whole.astype(jnp.promote_types(whole.dtype, jnp.float32))


def _resolved_chunk(chunk: Any, default: int | None) -> int | None:
    if chunk is None:
        return default
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise PlanError(
            f"token_logprobs(chunk={chunk!r}): expected a positive integer (sequence positions of "
            "logits computed at a time), or None for the model's GPTConfig.loss_chunk."
        )
    return chunk
