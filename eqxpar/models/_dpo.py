"""`dpo_loss`: direct preference optimisation as a loss for `make_step`, with a
reference that costs no second copy of the model; `preference_losses`, its
math on per-sequence log-probabilities; `PolicyWithReference`, a frozen
reference carried in the trained pytree.

A batch is a dict of pairs (`chosen` and `rejected` token rows of the same
pair share a row index), so every split a plan makes of it (data-parallel
shards, `accumulate=` micro-batches, a pipeline's micro-batches: all cut the
leading dimension) keeps each pair whole, with the loss computing it where its
two sequences are.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree, Shaped

from .._context_split import context_size
from .._errors import BatchError, PlanError
from .._mesh import CONTEXT_AXIS
from .._varying import mark_varying
from ..nn._sequence import split_context, split_tensor_sequence
from ..pipeline import PipelineLoss
from ._gpt import GPT, _no_pipeline, _run_blocks, gpt_first, token_losses
from ._lora import has_lora, without_lora

#: The preference losses `dpo_loss` computes, as TRL names them.
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
#: The keys of a preference batch (`dpo_loss`): token rows and their weights.
PAIR_KEYS = ("chosen", "rejected", "chosen_weights", "rejected_weights")
#: Optional keys: reference log-probabilities computed before the step.
REFERENCE_KEYS = ("reference_chosen", "reference_rejected")


class PolicyWithReference(eqx.Module):
    """The model `dpo_loss` trains (`policy`) beside a frozen reference model
    (`reference`, typically a copy of the policy as it starts), as one pytree
    for `eqxpar.train.init` and `make_step`.

    The plan places both alike (every leaf by its logical axes), so the reference
    is sharded as the policy is. Leave it out of training with
    `trainable=PolicyWithReference.frozen_reference()`: it then gets no
    gradient and no optimizer state, and `dpo_loss` computes its log-probs
    without a backward pass. (With LoRA adapters on the policy, the base with its
    adapters off is the reference: pass the adapted model to `dpo_loss` directly,
    with no second model at all.)

    ```python
    pair = eqxpar.models.PolicyWithReference(policy=model, reference=model)
    trainable = eqxpar.models.PolicyWithReference.frozen_reference()
    state = eqxpar.train.init(pair, optimizer, plan, key=key, trainable=trainable)
    step = eqxpar.train.make_step(eqxpar.models.dpo_loss, optimizer, plan, trainable=trainable)
    ```
    """

    policy: PyTree
    reference: PyTree

    @staticmethod
    def frozen_reference(policy: Any = True) -> "PolicyWithReference":
        """The `trainable=` filter that trains `policy` (a filter of the policy:
        True for all of it, or e.g. `lora_trainable(policy)`) and nothing of the
        reference."""
        return PolicyWithReference(policy=policy, reference=False)


def preference_losses(
    policy_chosen: Float[Array, " pairs"],
    policy_rejected: Float[Array, " pairs"],
    reference_chosen: Float[Array, " pairs"],
    reference_rejected: Float[Array, " pairs"],
    *,
    # Any: checked below, with eqxpar errors that name the value.
    beta: Any,
    loss_type: Any = "sigmoid",
) -> Float[Array, " pairs"]:
    """The per-pair preference loss of TRL's `DPOTrainer` from the chosen and
    rejected sequences' log-probabilities under the policy and the reference.

    With `delta = (policy_chosen - reference_chosen) - (policy_rejected -
    reference_rejected)`:

    - `"sigmoid"` (DPO): `-log sigmoid(beta * delta)`;
    - `"hinge"` (SLiC): `max(0, 1 - beta * delta)`;
    - `"ipo"` (IPO): `(delta - 1 / (2 beta))^2`. TRL feeds it log-probabilities
      averaged over each completion's tokens rather than summed (`dpo_loss`
      does the same).

    **Arguments:** the four log-probabilities, `(pairs,)` each (sums over the
    completion tokens: `sequence_logprobs`); keyword-only `beta` (> 0) and
    `loss_type`.

    **Returns:** `(pairs,)` losses (their mean is the loss).

    ```python
    losses = eqxpar.models.preference_losses(pc, pr, rc, rr, beta=0.1)
    ```
    """
    _check_options(beta, loss_type, "preference_losses")
    delta = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    if loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(beta * delta)
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * delta)
    return (delta - 1 / (2 * beta)) ** 2


def _check_options(beta: Any, loss_type: Any, where: str) -> None:
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not beta > 0:
        raise PlanError(f"{where}(beta={beta!r}): expected a positive number (TRL's default: beta=0.1).")
    if loss_type not in LOSS_TYPES:
        raise PlanError(f"{where}(loss_type={loss_type!r}): expected one of {LOSS_TYPES}.")


def _token_logprobs(model: GPT, tokens: Array, key: PRNGKeyArray | None) -> Array:
    """`log p(tokens[:, t+1] | tokens[:, :t+1])` per token, float32, in the layout
    the model's cross-entropy gives (this device's part of a split sequence)."""
    # An MoE model's auxiliary losses are left out, as TRL leaves them by default.
    h, _ = _run_blocks(model, model.embed_tokens(tokens[:, :-1]), key)
    return _head_logprobs(model, h, tokens)


def _head_logprobs(model: GPT, h: Array, tokens: Array) -> Array:
    """The per-token log-probabilities of the blocks' output `h`: final norm, head
    and log-softmax, `token_logprobs`'s own (`_gpt.token_losses`: the chunked
    head when `config.loss_chunk` is set, in vocabulary tiles under automatic
    FSDP), in the layout the head gives."""
    return -token_losses(model, h, tokens[:, 1:], model.config.loss_chunk)


def sequence_logprobs(
    model: GPT,
    tokens: Int[Array, "batch seq_plus_1"],
    weights: Shaped[Array, "batch seq_plus_1"],
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, " batch"]:
    """Each row's weighted sum of next-token log-probabilities: `sum_t weights[b, t]
    * log p(tokens[b, t] | tokens[b, :t])` over `t >= 1` (weights 1 on a
    completion's tokens, 0 on its prompt and padding: the completion's
    log-probability; TRL's completion mask).

    Under every plan: where a device holds part of the sequence (context
    parallelism; sequence parallelism with a whole-vocabulary head), it sums its
    part and the parts are summed over the devices that split it.

    **Arguments:** `model` (a `GPT`); `tokens` `(batch, seq + 1)` ids; `weights`
    `(batch, seq + 1)` aligned with `tokens`, as `lm_loss`'s (entry `t` weighs the
    prediction of `tokens[:, t]`; entry 0, which nothing predicts, is unused);
    keyword-only `key` (LoRA adapter dropout, as `lm_loss`'s).

    **Returns:** `(batch,)` float32.

    ```python
    logp = eqxpar.models.sequence_logprobs(model, tokens, completion_mask)
    ```
    """
    if weights.shape != tokens.shape:
        raise BatchError(
            f"sequence_logprobs: weights of shape {tuple(weights.shape)} for tokens of shape "
            f"{tuple(tokens.shape)}; expected the tokens' shape (entry t weighs the prediction of token t)."
        )
    return _logprob_sums(model, tokens, weights[:, 1:], key)


def _logprob_sums(model: GPT, tokens: Array, weights: Array, key: PRNGKeyArray | None) -> Array:
    """`sequence_logprobs` with the predictions' weights `(batch, seq)`."""
    return _weighted_sums(model, _token_logprobs(model, tokens, key), weights)


def _weighted_sums(model: GPT, per_token: Array, weights: Array) -> Array:
    """`sum_t weights * per_token` per row, `weights` `(batch, seq)` (the
    predictions'); `per_token` the whole sequence, or in the layout the head gives
    (this device's part of a split sequence, see `sequence_logprobs`)."""
    head = model.embed if model.head is None else model.head
    weights = weights.astype(per_token.dtype)
    axes = []
    if per_token.shape[1] != weights.shape[1] and context_size() > 1:
        weights = split_context(weights)
        axes.append(CONTEXT_AXIS)
    if per_token.shape[1] != weights.shape[1]:
        # Sequence parallelism in manual mode, a whole-vocabulary head: this block only.
        weights = split_tensor_sequence(weights, axis=head.axis)
        axes.append(head.axis)
    sums = jnp.sum(per_token * weights, axis=1)
    if axes:
        sums = jax.lax.psum(sums, tuple(axes))
    if context_size() > 1:
        # A step averages a loss over `context` as over the batch (each device's
        # share; see `eqxpar.nn.sequence_mean`): typed varying there, each device's
        # copy of the whole sum is one share of that average, and the gradient each
        # device gets back is its part of the sequence's. (A no-op where it varies.)
        sums = mark_varying(sums, frozenset({CONTEXT_AXIS}))
    return sums


def _check_batch(batch: Any) -> tuple[int, int]:
    """`(pairs, seq + 1)` of a preference batch, or a `BatchError` naming the format."""
    fmt = (
        "a dict of pairs: 'chosen' and 'rejected' token ids (pairs, seq + 1), row i of each the two "
        "completions of pair i (right-padded to one length), and 'chosen_weights', 'rejected_weights' "
        "of the same shape, 1.0 on completion tokens and 0.0 on the prompt and padding; "
        f"optionally {REFERENCE_KEYS} (pairs,), reference log-probs computed beforehand"
    )
    if not isinstance(batch, dict):
        shape = getattr(batch, "shape", None)
        raise BatchError(
            f"dpo_loss: got a batch of type {type(batch).__name__}"
            + (f" (shape {tuple(shape)})" if shape is not None else "")
            + f"; expected {fmt}. Chosen and rejected rows stacked in one array would be cut apart "
            "by the plan's data-parallel split and by accumulate= / pipeline micro-batches; keyed by "
            "pair, no split separates them."
        )
    keys = set(batch)
    missing = [k for k in PAIR_KEYS if k not in keys]
    unknown = sorted(keys - set(PAIR_KEYS) - set(REFERENCE_KEYS))
    given = [k for k in REFERENCE_KEYS if k in keys]
    if missing or unknown or len(given) == 1:
        raise BatchError(
            f"dpo_loss: the batch has keys {sorted(keys)} (missing {missing}, unknown {unknown}"
            + (f", {given} without its partner" if len(given) == 1 else "")
            + f"); expected {fmt}."
        )
    chosen, rejected = batch["chosen"], batch["rejected"]
    if chosen.ndim != 2 or chosen.shape != rejected.shape or chosen.shape[1] < 2:
        raise BatchError(
            f"dpo_loss: 'chosen' of shape {tuple(chosen.shape)} and 'rejected' of shape "
            f"{tuple(rejected.shape)}; expected one shape (pairs, seq + 1), seq + 1 >= 2: one row per "
            "pair in each, both right-padded to the same length (padding weighted 0)."
        )
    if not (jnp.issubdtype(chosen.dtype, jnp.integer) and jnp.issubdtype(rejected.dtype, jnp.integer)):
        raise BatchError(
            f"dpo_loss: 'chosen' / 'rejected' of dtypes {chosen.dtype} / {rejected.dtype}; expected "
            "integer token ids."
        )
    pairs, length = chosen.shape
    for name in ("chosen_weights", "rejected_weights"):
        w = batch[name]
        if w.shape != (pairs, length):
            raise BatchError(
                f"dpo_loss: {name!r} of shape {tuple(w.shape)}; expected {(pairs, length)}, the tokens' "
                "shape: entry t weighs the prediction of token t (TRL's completion mask)."
            )
    for name in given:
        if batch[name].shape != (pairs,):
            raise BatchError(
                f"dpo_loss: {name!r} of shape {tuple(batch[name].shape)}; expected {(pairs,)}, one "
                "reference log-prob per pair."
            )
    return pairs, length


def _pairs_as_rows(chosen: Array, rejected: Array) -> Array:
    """`(pairs, ...)` twice as `(2 pairs, ...)`, pair i's chosen at row 2i and its
    rejected at 2i + 1: rows of one pair stay adjacent, so a batch split over
    devices by pairs is split the same way by rows and the reshape moves no data
    (a concatenation would put the rejected half on other devices)."""
    return jnp.stack([chosen, rejected], axis=1).reshape(-1, *chosen.shape[1:])


def _policy_and_reference(model: PyTree) -> tuple[GPT, GPT | None]:
    if isinstance(model, PolicyWithReference):
        return model.policy, model.reference
    if has_lora(model):
        return model, without_lora(model)
    return model, None


def dpo_loss(
    model: PyTree,
    # Any: checked below, with an eqxpar error that names the pair format.
    batch: Any,
    *,
    # Any: checked below, with eqxpar errors that name the value.
    beta: Any = 0.1,
    loss_type: Any = "sigmoid",
    metrics: bool = False,
    key: PRNGKeyArray | None = None,
) -> Float[Array, ""] | tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The DPO loss of a batch of preference pairs (as TRL's `DPOTrainer`), a
    loss for `eqxpar.train.make_step` under any plan.

    The policy's log-probabilities of each pair's chosen and rejected completions
    (`sequence_logprobs`, one forward over both) are compared with a
    reference's (`preference_losses`); the loss is the mean over pairs. The
    reference, whose log-probs get no gradient, is:

    - with LoRA adapters on `model` (`add_lora`): the same model with its
      adapters switched off (`without_lora`, the same weights, no copy);
    - with a `PolicyWithReference`: its frozen `reference` model;
    - with `reference_chosen` / `reference_rejected` in the batch: those values
      (computed beforehand, e.g. by an eval step; the step then runs no reference).

    **Arguments:**

    - `model`: a `GPT` with adapters, a `PolicyWithReference`, or a `GPT` with
      reference log-probs in the batch.
    - `batch`: a dict of pairs: `chosen`, `rejected` `(pairs, seq + 1)` token ids
      (row i of each the two completions of pair i's prompt, right-padded to one
      length); `chosen_weights`, `rejected_weights` `(pairs, seq + 1)`, aligned
      with the tokens as `lm_loss`'s weights (TRL's completion mask): 1.0 on
      completion tokens, 0.0 on the prompt and padding; optionally `reference_chosen`, `reference_rejected` `(pairs,)`.
      Every split a plan makes cuts pairs, never a pair.
    - `beta`: the preference strength (keyword-only; default 0.1, TRL's).
    - `loss_type`: `"sigmoid"` (DPO), `"ipo"` (on per-token mean log-probs, as
      TRL) or `"hinge"` (keyword-only).
    - `metrics`: also return TRL's reward metrics (keyword-only; then pass
      `make_step(..., has_aux=True)`): the means over pairs of `rewards_chosen`
      `beta * (policy - reference)`, `rewards_rejected`, `reward_margin` and
      `reward_accuracy` (chosen reward above rejected).
    - `key`: LoRA adapter dropout, as `lm_loss`'s (keyword-only; `make_step`
      passes it).

    **Returns:** the scalar loss, or `(loss, metrics)`.

    ```python
    loss_fn = functools.partial(eqxpar.models.dpo_loss, beta=0.1)
    step = eqxpar.train.make_step(loss_fn, optimizer, plan, trainable=eqxpar.models.lora_trainable(model))
    state, out = step(state, {"chosen": c, "rejected": r, "chosen_weights": cw, "rejected_weights": rw})
    ```
    """
    _check_options(beta, loss_type, "dpo_loss")
    pairs, _ = _check_batch(batch)
    policy, reference = _policy_and_reference(model)
    precomputed = REFERENCE_KEYS[0] in batch
    if reference is None and not precomputed:
        raise PlanError(
            f"dpo_loss: the model ({type(model).__name__}) has no LoRA adapters and the batch no reference "
            f"log-probs, so there is no reference. Add adapters (eqxpar.models.add_lora: the base is the "
            f"reference), pass eqxpar.models.PolicyWithReference(policy=model, reference=frozen_copy), or "
            f"put {REFERENCE_KEYS} (pairs,) in the batch."
        )
    tokens, weights = _rows(batch)
    logps = _logprob_sums(policy, tokens, weights, key)
    if precomputed:
        ref = _precomputed(batch)
    else:
        ref = jax.lax.stop_gradient(_logprob_sums(reference, tokens, weights, None).reshape(pairs, 2))
    return _preference_loss(logps.reshape(pairs, 2), ref, weights, beta, loss_type, metrics)


def _rows(batch: dict[str, Array]) -> tuple[Array, Array]:
    """The pairs' tokens `(2 pairs, seq + 1)` and their predictions' weights
    `(2 pairs, seq)`, float32."""
    tokens = _pairs_as_rows(batch["chosen"], batch["rejected"])
    weights = _pairs_as_rows(batch["chosen_weights"], batch["rejected_weights"])
    return tokens, weights[:, 1:].astype(jnp.float32)


def _precomputed(batch: dict[str, Array]) -> Array:
    return jnp.stack([batch[k].astype(jnp.float32) for k in REFERENCE_KEYS], axis=1)


def _preference_loss(
    logps: Array, ref: Array, weights: Array, beta: float, loss_type: str, metrics: bool
) -> Array | tuple[Array, dict[str, Array]]:
    """The mean preference loss (and metrics) of `(pairs, 2)` policy and reference
    log-probs, chosen first; `weights` `(2 pairs, seq)` for IPO's token counts."""
    ratios = logps - ref
    if loss_type == "ipo":
        # IPO compares per-token means (TRL divides by the completion's token count).
        ratios_for_loss = ratios / jnp.maximum(jnp.sum(weights, axis=1), 1.0).reshape(ratios.shape)
    else:
        ratios_for_loss = ratios
    zeros = jnp.zeros_like(ratios[:, 0])
    chosen, rejected = ratios_for_loss[:, 0], ratios_for_loss[:, 1]
    loss = jnp.mean(preference_losses(chosen, rejected, zeros, zeros, beta=beta, loss_type=loss_type))
    if not metrics:
        return loss
    rewards = beta * jax.lax.stop_gradient(ratios)
    return loss, {
        "rewards_chosen": jnp.mean(rewards[:, 0]),
        "rewards_rejected": jnp.mean(rewards[:, 1]),
        "reward_margin": jnp.mean(rewards[:, 0] - rewards[:, 1]),
        "reward_accuracy": jnp.mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
    }


def dpo_pipeline_loss(*, beta: Any = 0.1, loss_type: Any = "sigmoid") -> PipelineLoss:
    """`dpo_loss` cut for a pipeline plan: an `eqxpar.pipeline.PipelineLoss` whose
    first stage embeds each micro-batch's pairs and whose last stage scores them
    against the reference log-probs the batch carries.

    A pipeline runs the stack once per micro-batch, so the reference is not run
    in the step: compute `reference_chosen` / `reference_rejected` beforehand
    (`sequence_logprobs` of the reference, e.g. `without_lora(model)`, under a
    plan without pipe or on one device) and put them in the batch. Micro-batches
    are cut by pairs, so each stays whole.

    **Arguments:** keyword-only `beta`, `loss_type`, as `dpo_loss`'s.

    **Returns:** a `PipelineLoss` for `make_step` under a plan with a schedule
    (dense GPTs, as `gpt_first` / `gpt_last`).

    ```python
    step = eqxpar.train.make_step(eqxpar.models.dpo_pipeline_loss(beta=0.1), optimizer, plan)
    ```
    """
    _check_options(beta, loss_type, "dpo_pipeline_loss")

    def first(model: GPT, batch: Any) -> Array:
        _check_batch(batch)
        if REFERENCE_KEYS[0] not in batch:
            raise PlanError(
                f"dpo_pipeline_loss: the batch has no {REFERENCE_KEYS}. A pipeline runs the stack once "
                "per micro-batch, the policy's; compute the reference log-probs beforehand "
                "(eqxpar.models.sequence_logprobs of the reference, e.g. without_lora(model)) and put them "
                "in the batch, or train under a plan without pipe with eqxpar.models.dpo_loss."
            )
        tokens, _ = _rows(batch)
        return gpt_first(model, tokens)

    def last(model: GPT, h: Array, batch: Any) -> Array:
        pairs, _ = _check_batch(batch)
        tokens, weights = _rows(batch)
        _no_pipeline(model, "dpo_pipeline_loss")
        logps = _weighted_sums(model, _head_logprobs(model, h, tokens), weights).reshape(pairs, 2)
        return _preference_loss(logps, _precomputed(batch), weights, beta, loss_type, False)

    return PipelineLoss(first, lambda m: m.blocks, last)
