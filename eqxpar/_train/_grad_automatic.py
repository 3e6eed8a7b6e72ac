"""Gradients under an automatic plan: one `jax.jit` program whose collectives the
compiler (GSPMD) places from the parameters' and the batch's shardings."""

from typing import Any

from jaxtyping import Array, PyTree

from .._sharding import place_tree
from ._grad_common import LossFunction, accumulated_value_and_grad, normalised, specs_for, value_and_grad
from ._step_layout import StepLayout


def automatic_gradients(
    loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any
) -> tuple[Array, PyTree, PyTree]:
    """Loss, aux and gradients over the global batch; the gradients take the
    layout's `updates` specs (FSDP: the compiler reduces them to shards)."""
    params, static = layout.differentiated(model)
    batch = loss.compute(batch)
    if layout.accumulate == 1:
        value, aux, grads = value_and_grad(loss, params, static, batch, key)
    else:
        value, aux, grads = accumulated_value_and_grad(loss, params, static, batch, key, layout=layout)
    # The arrays are the global batch's: a weighted mean's sums are the whole batch's.
    value, grads = normalised(value, grads)
    return value, aux, place_tree(grads, layout.plan.mesh, specs_for(grads, layout.updates))
