"""`PipelineLoss`: a loss given in the three parts a pipeline runs separately."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float, PyTree

from .._errors import PlanError
from .._weighted import WeightedMean
from ..nn._attention import Attention
from ..nn._linear import MLP
from ..nn._lora import lora_dropout
from ..nn._stack import Stacked


def _has_lora(x: Any) -> bool:
    return isinstance(x, Attention | MLP)


class PipelineLoss(eqx.Module):
    """A loss function in three parts, so that a pipeline can run the middle one.

    A pipeline engine must run the model's stack of blocks itself, stage by stage
    and micro-batch by micro-batch, so it needs the loss cut where the stack
    starts and ends:

    - `first(model, batch) -> activations`: everything before the stack (e.g. the
      embedding), on one micro-batch; activations have the micro-batch's rows as
      their leading dimension. Runs on the first pipeline stage.
    - `stack(model) -> eqxpar.nn.Stacked`: which stack to pipeline, e.g.
      `lambda m: m.blocks`. Its layers are split over mesh axis `pipe`.
    - `last(model, activations, batch) -> loss`: everything after the stack (e.g.
      final norm, head and cross-entropy), the mean over the micro-batch's rows.
      Runs on the last pipeline stage.

    `first` and `last` must not use the stack (under a pipeline they see only
    the current stage's part of it).

    - `stack_kwargs(batch) -> dict` (keyword-only, optional): keyword arguments
      the stack takes with each micro-batch, e.g. the segment ids and positions of
      packed documents (`eqxpar.models.gpt_stack_kwargs`); default None: none.
      Leaves of that micro-batch, so they travel to every stage with it.

    `last` may return an `eqxpar.train.WeightedMean` (a weighted sum and its
    weight: packed or masked tokens) instead of a mean: the step then adds the
    sums over the micro-batches and the data-parallel devices and divides once,
    by the weight of the whole batch (every micro-batch of one plan must return
    the same kind).

    Called as `loss(model, batch)` it is the plain sequential composition
    `last(model, stack(model)(first(model, batch)), batch)`: an ordinary loss
    function for non-pipeline plans and for a single-device reference (a stack
    the plan stored in a pipeline's order runs its layers in natural order there).

    ```python
    loss = eqxpar.pipeline.PipelineLoss(
        first=lambda m, batch: m.embed(batch[:, :-1]),
        stack=lambda m: m.blocks,
        last=lambda m, h, batch: jnp.mean(
            eqxpar.nn.cross_entropy(m.head(m.norm(h)), batch[:, 1:], head=m.head)
        ),
    )
    step = eqxpar.train.make_step(loss, optax.adam(1e-3), plan)
    ```
    """

    first: Callable[[Any, PyTree], PyTree]
    stack: Callable[[Any], Stacked]
    last: Callable[[Any, PyTree, PyTree], Float[Array, ""] | WeightedMean]
    stack_kwargs: Callable[[PyTree], dict[str, Any]] | None = None

    def __init__(
        self,
        first: Callable[[Any, PyTree], PyTree],
        stack: Callable[[Any], Stacked],
        last: Callable[[Any, PyTree, PyTree], Float[Array, ""] | WeightedMean],
        *,
        stack_kwargs: Callable[[PyTree], dict[str, Any]] | None = None,
    ):
        parts = (("first", first), ("stack", stack), ("last", last))
        if stack_kwargs is not None:
            parts += (("stack_kwargs", stack_kwargs),)
        for name, fn in parts:
            if not callable(fn):
                raise PlanError(f"PipelineLoss({name}={fn!r}): expected a callable.")
        self.first, self.stack, self.last = first, stack, last
        self.stack_kwargs = stack_kwargs

    def stack_inputs(self, batch: PyTree) -> dict[str, Any]:
        """`stack_kwargs(batch)`, checked to be a dict (`{}` without `stack_kwargs`)."""
        if self.stack_kwargs is None:
            return {}
        kwargs = self.stack_kwargs(batch)
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise PlanError(
                f"PipelineLoss.stack_kwargs(batch) returned {type(kwargs).__name__}; expected a dict of "
                "keyword arguments for the stack's call, e.g. {'segment_ids': ...}."
            )
        return kwargs

    def stack_of(self, model: Any) -> Stacked:
        """`stack(model)`, checked to be an `eqxpar.nn.Stacked`."""
        found = self.stack(model)
        if not isinstance(found, Stacked):
            raise PlanError(
                f"PipelineLoss.stack(model) returned {type(found).__name__}, expected an "
                "eqxpar.nn.Stacked (identical blocks with a leading 'layers' axis). Build the "
                "blocks with eqxpar.nn.Stacked(make_block, depth=..., key=...), or convert a list "
                "with eqxpar.nn.Stacked.from_blocks(blocks)."
            )
        rates = {lora_dropout(x) for x in jax.tree.leaves(found, is_leaf=_has_lora) if _has_lora(x)}
        if any(rates):
            raise PlanError(
                f"PipelineLoss: the stack's LoRA adapters drop out (dropout={max(rates)}), but a "
                "PipelineLoss passes its stack no key (a pipeline's stages run without one), so they "
                "would train without dropout. For a pipeline build the adapters with "
                "eqxpar.models.add_lora(..., dropout=0.0), or train them under a plan without pipe "
                "with a loss taking key= (eqxpar.models.lm_loss)."
            )
        return found

    def __call__(self, model: Any, batch: PyTree) -> Float[Array, ""] | WeightedMean:
        h = self.first(model, batch)
        h = self.stack_of(model)(h, **self.stack_inputs(batch))
        return self.last(model, h, batch)
