"""`WeightedMean`: a loss kept as a weighted sum and its weight, shared by the
models (whose losses return one for packed or masked tokens) and the train and
eval steps (which add the two sums over devices and micro-batches before dividing).

Averaging per-part means is exact only when every part weighs the same. Packed
rows and masked tokens (prompts, padding) give the parts of a batch different
numbers of counted tokens, so the mean over the whole batch is `sum(total) /
sum(weight)` over the parts, which only the sums let a step compute.
"""

import equinox as eqx
import jax
from jaxtyping import Array, Float


class WeightedMean(eqx.Module):
    """A mean `total / weight` kept as its two sums, so that a step can add them
    over data-parallel devices, accumulation micro-batches and pipeline
    micro-batches, and divide once by the weight of the whole batch.

    A loss function may return one instead of a scalar mean (as
    `eqxpar.models.lm_loss` does with `weights=` or `segment_ids=`). The steps
    (`eqxpar.train.make_step`, `make_value_and_grad`, `make_eval_step`, a
    `PipelineLoss`'s `last`) then report `sum(total) / sum(weight)` over the whole
    batch and differentiate that: the gradient of the summed `total`s divided by
    the summed `weight`. The weight counts what the mean is over (tokens, or
    weighted tokens) and must not depend on the parameters (it is treated as a
    constant).

    **Fields:** `total` (float scalar: the sum of weight times loss over the
    call's tokens), `weight` (float scalar: the sum of the weights).

    ```python
    w = (labels != pad).astype(jnp.float32)
    out = eqxpar.train.WeightedMean(jnp.sum(w * per_token), jnp.sum(w))
    out.value()                                  # the mean over the counted tokens
    ```
    """

    total: Float[Array, ""]
    weight: Float[Array, ""]

    def value(self) -> Float[Array, ""]:
        """`total / weight`: the mean these sums stand for (NaN for a weight of 0)."""
        return self.total / self.weight.astype(self.total.dtype)


def constant_weight(weight: Array) -> Array:
    """`weight` cut from autodiff: what a mean is over is never trained."""
    return jax.lax.stop_gradient(weight)
