"""Where a pipelined stack's layers live: the rule that splits them over `pipe`,
and the storage order of interleaved (several chunks per device) and uneven
(`Plan(stage_layers=...)`) stacks, as low-level functions (the plan owns the order)."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._errors import DivisibilityError, PlanError
from .._plan import checked_stage_layers
from .._rules import Leaf, Rule, as_rules, mesh_axis_names
from .._stack_order import StackOrder, describe_order, pipeline_order
from ..nn._stack import Stacked


@dataclasses.dataclass(frozen=True, init=False)
class StageRules:
    """A rule that splits the layer axis of every scanned stack over `pipe`.

    Wraps other rules: a leaf of an `eqxpar.nn.Stacked` (a leaf with a leading
    stack dimension) gets the spec the wrapped rules give it with its first entry
    replaced by `axis`; every other leaf gets the wrapped rules' spec. Build it
    with `eqxpar.pipeline.stage_rules`.
    """

    rules: tuple[Rule, ...]
    axis: str

    def __init__(self, rules: Any = None, *, axis: Any = "pipe"):
        if not isinstance(axis, str):
            raise PlanError(
                f"stage_rules(axis={axis!r}): expected the name (str) of the mesh axis the stages are "
                "split over, e.g. axis='pipe'."
            )
        object.__setattr__(self, "rules", as_rules(rules))
        object.__setattr__(self, "axis", axis)

    def mesh_axes(self) -> set[str]:
        out = {self.axis}
        for rule in self.rules:
            declared = getattr(rule, "mesh_axes", None)
            out |= set(declared() if declared else ())
        return out

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        found = None
        for rule in self.rules:
            found = rule.spec(leaf)
            if found is not None:
                break
        if leaf.leading < 1:
            return found
        if found is None:
            found = PartitionSpec()
        entries = list(found if isinstance(found, PartitionSpec) else PartitionSpec(*found))
        entries += [None] * (len(leaf.shape) - len(entries))
        # The pipe axis can split one dimension only: drop it from the others.
        for i, entry in enumerate(entries[1:], start=1):
            names = tuple(a for a in mesh_axis_names(entry) if a != self.axis)
            entries[i] = None if not names else names[0] if len(names) == 1 else names
        entries[0] = self.axis
        return PartitionSpec(*entries)


def stage_rules(*rules: Any, axis: Any = "pipe") -> StageRules:
    """Rules for a pipeline plan: `rules`, plus the layer axis of every
    `eqxpar.nn.Stacked` split over `axis`, so that device `s` of `pipe` stores a
    contiguous run of layers: stage `s`.

    **Arguments:** the rules to wrap (none: replicate everything else), and
    keyword-only `axis` (default `"pipe"`).

    **Returns:** one rule, for `Plan(rules=...)`.

    ```python
    plan = eqxpar.Plan(eqxpar.make_mesh(pipe=2, data=2, tensor=2),
                       rules=eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON),
                       schedule="1f1b", microbatches=4)
    ```
    """
    return StageRules(rules, axis=axis)


def stored_rows(
    depth: int, stages: int, chunks: int, stage_layers: Sequence[int] | None = None
) -> np.ndarray:
    """`rows[r]` = the sequential layer stored at row `r` (pipeline order), -1
    for a padding slot: device `d` stores its chunks `0, 1, ...` one after the
    other, each in `max(stage_layers)` slots (`depth / (stages * chunks)`
    without `stage_layers`), virtual stage `k = c * stages + d`'s layers first."""
    order = _order(depth, stages, chunks, stage_layers)
    return np.arange(depth) if order is None else order.rows()


def _order(depth: int, stages: int, chunks: int, stage_layers: Sequence[int] | None) -> StackOrder | None:
    if stage_layers is None:
        if depth % (stages * chunks):
            raise DivisibilityError(
                f"a stack of depth {depth} does not split into {stages} stages x {chunks} chunks; "
                f"use a depth that is a multiple of {stages * chunks}, or give the layers per "
                "virtual stage (stage_layers=...)."
            )
    else:
        stage_layers = checked_stage_layers(stage_layers, stages=stages, chunks=chunks, depth=depth)
    return pipeline_order(depth, stages=stages, chunks=chunks, stage_layers=stage_layers)


def to_pipeline_order(
    stack: Stacked, *, stages: int, chunks: int, stage_layers: Sequence[int] | None = None
) -> Stacked:
    """The stack stored in the order a pipeline of `stages` x `chunks` stores it
    in, that order recorded on it (`Stacked.order`). A low-level function: the
    plan owns the order, and `eqxpar.train.init`, `eqxpar.shard`,
    `from_pretrained(path, plan)` and a checkpoint restore apply it; no user code
    needs to call this.

    With `stages` devices and `chunks` chunks per device there are `stages *
    chunks` virtual stages of `n = depth / (stages * chunks)` layers; virtual
    stage `k` (sequential layers `k * n ... k * n + n - 1`) runs on device `k %
    stages` as its chunk `k // stages`. The pipe axis splits the stored layer
    axis into contiguous runs, so device `d` must store its chunks `0, 1, ...`
    one after the other: stored row `d * (depth / stages) + c * n + j` holds
    sequential layer `(c * stages + d) * n + j`. With `chunks == 1` this is the
    identity.

    With `stage_layers` (`Plan(stage_layers=...)`: virtual stage `k` runs
    `stage_layers[k]` layers) every chunk is stored in `n = max(stage_layers)`
    slots, its stage's layers first and zeros after them: the stored stack has
    `stages * chunks * n` rows.

    Works on the stack of a model, of its gradients or of its optimizer moments
    (any `Stacked`-shaped tree), from whatever order it is recorded in (so a
    stack is never permuted twice). `from_pipeline_order` undoes it.

    **Arguments:** `stack`; keyword-only `stages` (size of `pipe`), `chunks`,
    `stage_layers` (default None: equal stages).

    **Returns:** the stack with its layers permuted (and padded).

    ```python
    stored = eqxpar.pipeline.to_pipeline_order(model.blocks, stages=4, chunks=2)
    ```
    """
    stack = _checked(stack)
    return stack.stored_in(_order(stack.layers, stages, chunks, stage_layers))


def from_pipeline_order(
    stack: Stacked, *, stages: int, chunks: int, stage_layers: Sequence[int] | None = None
) -> Stacked:
    """Undo `to_pipeline_order`: layers back in sequential order, padding dropped.
    A low-level function: `eqxpar.nn.in_natural_order` does this for every stack
    of any tree from the order recorded on it.

    **Arguments:** `stack` (in pipeline order); keyword-only `stages`, `chunks`,
    `stage_layers` (those it was stored with; checked against the order the stack
    records).

    **Returns:** the stack with layer `i` at row `i`.

    ```python
    blocks = eqxpar.pipeline.from_pipeline_order(stored, stages=4, chunks=2)
    ```
    """
    stack = _checked(stack)
    if stack.order is not None:
        given = _order(stack.order.layers, stages, chunks, stage_layers)
        if given != stack.order:
            raise PlanError(
                f"from_pipeline_order(stages={stages}, chunks={chunks}, stage_layers={stage_layers}): "
                f"the stack is stored in {stack.order.describe()}, not in {describe_order(given)}. "
                "Pass the stages, chunks and stage_layers it was stored with, or call "
                "eqxpar.nn.in_natural_order, which reads them from the stack."
            )
    return stack.stored_in(None)


def _checked(stack: Any) -> Stacked:
    if not isinstance(stack, Stacked):
        raise PlanError(f"expected an eqxpar.nn.Stacked (or its gradients), got {type(stack).__name__}.")
    if not [x for x in jax.tree.leaves(stack.blocks) if eqx.is_array(x)]:
        raise PlanError("the stack holds no arrays; nothing to reorder.")
    return stack
