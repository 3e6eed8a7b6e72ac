"""Which leaves of a model train: `make_step(..., trainable=...)` and
`train.init(..., trainable=...)` resolve the user's filter here, once, into a
bool per leaf that the step layout carries to every gradient implementation and
to the update."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._errors import PlanError
from .._specs import is_array_like
from .._stack_order import StackOrdering, in_plan_order

# A leaf the filter leaves out (eqx.filter's `replace`): distinct from None, which
# a model may hold itself.
_LEFT_OUT = object()


def _is_floating(x: Any) -> bool:
    # Arrays and their outlines (eqxpar.inspect reads models as jax.eval_shape gives them).
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return eqx.is_inexact_array(x)


def _check_filter_leaves(trainable: PyTree, where: str) -> None:
    for leaf in jax.tree.leaves(trainable):
        if isinstance(leaf, (bool, np.bool_)) or callable(leaf):
            continue
        if eqx.is_array(leaf):
            raise PlanError(
                f"{where}(trainable=...): the filter holds an array (shape {leaf.shape}, dtype {leaf.dtype}); "
                "expected a bool or a callable at each leaf. A filter decides per leaf: a row mask over "
                "an eqxpar.nn.Stacked weight would freeze some layers of one array, whose gradient the "
                "stack's scan computes whole and the step reduces whole, so it would save neither FLOPs "
                "nor bytes. To train some layers only, keep the frozen ones in a Stacked of their own "
                "(trainable=False there), or zero their rows of the updates (optax.chain(optimizer, a "
                "transform multiplying updates by the mask)) with trainable left on."
            )
        raise PlanError(
            f"{where}(trainable=...): the filter holds {leaf!r}; expected a bool or a callable "
            "(leaf -> bool) at each leaf, as equinox filters take (e.g. eqx.is_inexact_array)."
        )


def trainable_mask(model: PyTree, trainable: Any, ordering: StackOrdering, *, where: str) -> PyTree | None:
    """`trainable` (an Equinox filter: a bool, a callable `leaf -> bool`, or a
    pytree of those that is a prefix of `model`) as a bool at every leaf of
    `model`: True where a floating-point array trains. None for `trainable=None`
    (every floating-point array trains).

    `model` is the model as the plan stores it; a pytree filter built on the model
    in natural order (as loaded) is put in the plan's stack order first
    (`ordering`: the resolved plan, or a plan), so that the same filter serves
    `train.init` and the step."""
    if trainable is None:
        return None
    if callable(trainable) and not isinstance(trainable, eqx.Module):
        spec = trainable
    else:
        _check_filter_leaves(trainable, where)
        spec = in_plan_order(trainable, ordering)
    try:
        chosen = eqx.filter(model, spec, replace=_LEFT_OUT)
    except ValueError as e:
        raise PlanError(
            f"{where}(trainable=...): the filter's structure is not a prefix of the model's "
            f"({str(e).splitlines()[0][:200]}). Build it from the model itself, e.g. "
            "jax.tree.map(lambda _: False, model) then eqx.tree_at(lambda m: m.head, mask, replace=True), "
            "or pass a callable leaf -> bool."
        ) from e
    leaves, treedef = jax.tree.flatten(model)
    chosen_leaves = treedef.flatten_up_to(chosen)
    mask = [_is_floating(x) and c is not _LEFT_OUT for x, c in zip(leaves, chosen_leaves, strict=True)]
    if not any(mask):
        raise PlanError(
            f"{where}(trainable=...): the filter selects no floating-point array of the model, so the "
            "step would train nothing. Select at least one weight (True, or a callable that returns "
            "True for it)."
        )
    return jax.tree.unflatten(treedef, mask)


def split_trainable(model: PyTree, mask: PyTree | None) -> tuple[PyTree, PyTree]:
    """`(params, rest)`: the arrays the step differentiates and updates (those of
    `mask`; every floating-point array for None), None elsewhere, and the rest of
    `model` (frozen weights, integers, non-arrays), None where `params` has one."""
    return eqx.partition(model, _is_floating if mask is None else mask)


def optimized(model: PyTree, mask: PyTree | None) -> PyTree:
    """What the optimizer state mirrors: every array of `model` without a filter
    (as `train.init` has always built it), else the trainable arrays only, so that
    a frozen weight has no optimizer state. Outlines (`jax.ShapeDtypeStruct`s, a
    state compiled from shapes) count as arrays."""
    return eqx.filter(model, is_array_like if mask is None else mask)
