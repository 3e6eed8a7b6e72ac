"""The order a scanned stack's layers are stored in (shared by the plan, which
decides it, `eqxpar.nn.Stacked`, which records it, and the pipeline engine,
which runs it).

A pipeline splits a stack's stored layer axis over `pipe` into contiguous runs,
one per device. With several chunks per device (interleaved), uneven stages
(`Plan(stage_layers=...)`) or a V placement, the layers a device runs are not a
contiguous run of the natural order, so the stack is stored permuted (and
padded). `StackOrder` names that storage; `None` stands for the natural order
(layer `i` at row `i`, no padding), which is also what every plan without such a
pipeline stores.

The stores in order are here too (`in_plan_order`, `in_natural_order`,
`check_stack_order`), over `OrderedStack`, what the core knows of a stack, so that
the core (`train.init`, `shard`, the step's filters, evaluation) and the
checkpoints need not import `eqxpar.nn`, whose `Stacked` is one.
"""

import abc
import dataclasses
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._errors import PlanError

#: Where a pipeline's virtual stages run: "loop" puts virtual stage `k` on device
#: `k % stages` as its chunk `k // stages`; "v" (two chunks) puts stages `d` and
#: `2 stages - 1 - d` on device `d`.
PLACEMENTS = ("loop", "v")


@dataclasses.dataclass(frozen=True)
class StackOrder:
    """A pipeline's storage order of a stack: `stages` devices, `chunks` chunks
    each, `stage_layers[k]` layers in virtual stage `k` (in the natural order of
    the stack, stage 0 first), `placement` as in `PLACEMENTS`.

    Device `d` stores its chunks `0, 1, ...` one after the other, each in
    `max(stage_layers)` slots: its virtual stage's layers first, padding (zeros)
    after them. `rows()[r]` is the natural layer stored at row `r`, -1 for a
    padding slot.
    """

    stages: int
    chunks: int
    stage_layers: tuple[int, ...]
    placement: str = "loop"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise PlanError(f"StackOrder(placement={self.placement!r}): expected one of {PLACEMENTS}.")
        if self.placement == "v" and self.chunks != 2:
            raise PlanError(f"a V placement runs 2 chunks per device, not {self.chunks}.")
        if len(self.stage_layers) != self.stages * self.chunks or min(self.stage_layers) < 1:
            raise PlanError(
                f"StackOrder: stage_layers={self.stage_layers} must be {self.stages} x {self.chunks} "
                "positive layer counts."
            )

    @property
    def layers(self) -> int:
        """Number of layers in natural order (without padding)."""
        return sum(self.stage_layers)

    @property
    def slots(self) -> int:
        """Stored rows: `stages * chunks * max(stage_layers)`."""
        return self.stages * self.chunks * max(self.stage_layers)

    def virtual_stage(self, device: int, chunk: int) -> int:
        """The virtual stage device `device` runs as its chunk `chunk`."""
        if self.placement == "v" and chunk == 1:
            return 2 * self.stages - 1 - device
        return chunk * self.stages + device

    def rows(self) -> np.ndarray:
        """`rows[r]`: the natural layer stored at row `r`, -1 for padding."""
        starts = np.cumsum((0,) + self.stage_layers)
        slots = max(self.stage_layers)
        rows: list[int] = []
        for device in range(self.stages):
            for chunk in range(self.chunks):
                k = self.virtual_stage(device, chunk)
                rows.extend(range(starts[k], starts[k + 1]))
                rows.extend([-1] * (slots - self.stage_layers[k]))
        return np.asarray(rows, dtype=np.int64)

    def natural_rows(self) -> np.ndarray:
        """`out[i]`: the stored row that holds natural layer `i`."""
        rows = self.rows()
        out = np.empty(self.layers, dtype=np.int64)
        stored = np.nonzero(rows >= 0)[0]
        out[rows[stored]] = stored
        return out

    def describe(self) -> str:
        """The order in words, for messages."""
        uneven = len(set(self.stage_layers)) > 1
        layers = f", stage_layers={self.stage_layers}" if uneven else ""
        return (
            f"pipeline order ({self.stages} stages x {self.chunks} chunks{layers}, "
            f"{self.placement} placement)"
        )


def describe_order(order: StackOrder | None) -> str:
    """`order` in words; None is the natural order."""
    return "natural order" if order is None else order.describe()


def pipeline_order(
    depth: int, *, stages: int, chunks: int, stage_layers: tuple[int, ...] | None, placement: str = "loop"
) -> StackOrder | None:
    """The order a pipeline of `stages` x `chunks` (virtual stages of
    `stage_layers` layers, or `depth / (stages * chunks)` each) stores a
    `depth`-layer stack in; None where that is the natural order. `depth` must
    match `stage_layers` (the caller checks and words the error)."""
    if stage_layers is None:
        stage_layers = (depth // (stages * chunks),) * (stages * chunks)
    order = StackOrder(stages, chunks, tuple(stage_layers), placement)
    rows = order.rows()
    if len(rows) == depth and np.array_equal(rows, np.arange(depth)):
        return None
    return order


class OrderedStack(eqx.Module):
    """A scanned stack whose layers may be stored permuted (`eqxpar.nn.Stacked`):
    what the core needs of it, so that it can reorder stacks without importing
    `eqxpar.nn`."""

    order: eqx.AbstractVar[StackOrder | None]

    @property
    @abc.abstractmethod
    def layers(self) -> int:
        """Number of layers (padding rows left out)."""

    @abc.abstractmethod
    def stored_in(self, order: StackOrder | None) -> "OrderedStack":
        """This stack's layers stored in `order` (None: natural order)."""


@runtime_checkable
class StackOrdering(Protocol):
    """Anything that says the order a stack of `depth` layers is stored in: an
    `eqxpar.Plan` (which decides it) or the step's resolved plan."""

    def stack_order(self, depth: int) -> StackOrder | None: ...


def _is_stack(x: Any) -> bool:
    return isinstance(x, OrderedStack)


def in_natural_order(tree: PyTree) -> PyTree:
    """`tree` (a model, its gradients, an optimizer state or a train state) with
    every `eqxpar.nn.Stacked` in it stored in natural order again: layer `i` at row
    `i`, no padding. What `save_pretrained` and a checkpoint save write; a no-op
    for stacks already in natural order.

    **Arguments:** `tree`, any pytree.

    **Returns:** the same structure, natural order recorded on every stack.

    ```python
    model = eqxpar.nn.in_natural_order(state.model)   # e.g. to compare with one device
    ```
    """
    return jax.tree.map(lambda s: s.stored_in(None) if _is_stack(s) else s, tree, is_leaf=_is_stack)


def in_plan_order(tree: PyTree, plan: StackOrdering) -> PyTree:
    """`tree` with every `eqxpar.nn.Stacked` in it stored in the order `plan`
    stores it in (`Plan.stack_order`: a pipeline's order for interleaved or uneven
    stages, else natural), from whatever order it is in now. `eqxpar.train.init`,
    `eqxpar.shard`, `from_pretrained(path, plan)` and a checkpoint restore call
    it; users do not need to.

    **Arguments:** `tree`, any pytree; `plan`, the target `eqxpar.Plan`.

    **Returns:** the same structure, the plan's order recorded on every stack.
    """
    return jax.tree.map(
        lambda s: s.stored_in(plan.stack_order(s.layers)) if _is_stack(s) else s, tree, is_leaf=_is_stack
    )


def check_stack_order(stack: OrderedStack, ordering: StackOrdering) -> None:
    """Raise `PlanError` unless `stack` is stored in the order `ordering` (the
    plan, resolved) runs it in. Shared with the pipeline engine."""
    wanted = ordering.stack_order(stack.layers)
    if stack.order != wanted:
        raise PlanError(
            f"the pipelined stack is stored in {describe_order(stack.order)}, but this plan runs it in "
            f"{describe_order(wanted)}. Let eqxpar place the model: build the state with "
            "eqxpar.train.init(model, optimizer, plan, ...), or pass the model through "
            "eqxpar.shard(model, plan) (both store every stack in the plan's order); do not reorder "
            "layers by hand."
        )
