"""Where a pipelined stack's layers live: the rule that splits them over `pipe`,
and the storage order of interleaved (several chunks per device) stacks."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._errors import DivisibilityError, PlanError
from .._rules import Leaf, Rule, as_rules, mesh_axis_names
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


def _permutation(depth: int, stages: int, chunks: int) -> np.ndarray:
    """`perm[r]` = the sequential layer stored at row `r` (pipeline order)."""
    if depth % (stages * chunks):
        raise DivisibilityError(
            f"a stack of depth {depth} does not split into {stages} stages x {chunks} chunks; "
            f"use a depth that is a multiple of {stages * chunks}."
        )
    per_chunk = depth // (stages * chunks)
    rows = []
    for device in range(stages):
        for chunk in range(chunks):
            start = (chunk * stages + device) * per_chunk
            rows.extend(range(start, start + per_chunk))
    return np.asarray(rows)


def _permute(stack: Stacked, order: np.ndarray) -> Stacked:
    if not isinstance(stack, Stacked):
        raise PlanError(f"expected an eqxpar.nn.Stacked (or its gradients), got {type(stack).__name__}.")
    blocks = jax.tree.map(lambda x: x[order] if eqx.is_array(x) else x, stack.blocks)
    return eqx.tree_at(lambda s: s.blocks, stack, blocks)


def to_pipeline_order(stack: Stacked, *, stages: int, chunks: int) -> Stacked:
    """Reorder a stack's layers from sequential order to the order an interleaved
    pipeline stores them in.

    With `stages` devices and `chunks` chunks per device there are `stages *
    chunks` virtual stages of `depth / (stages * chunks)` layers; virtual stage
    `k` (sequential layers `k * n ... k * n + n - 1`) runs on device `k % stages`
    as its chunk `k // stages`. The pipe axis splits the stored layer axis into
    contiguous runs, so device `d` must store its chunks `0, 1, ...` one after
    the other: stored row `d * (depth / stages) + c * n + j` holds sequential
    layer `(c * stages + d) * n + j`. With `chunks == 1` this is the identity.

    Works on the stack of a model, of its gradients or of its optimizer moments
    (any `Stacked`-shaped tree). `from_pipeline_order` undoes it.

    **Arguments:** `stack`; keyword-only `stages` (size of `pipe`), `chunks`.

    **Returns:** the stack with its layers permuted.

    ```python
    model = eqx.tree_at(lambda m: m.blocks, model,
                        eqxpar.pipeline.to_pipeline_order(model.blocks, stages=4, chunks=2))
    ```
    """
    return _permute(stack, _permutation(_depth(stack), stages, chunks))


def from_pipeline_order(stack: Stacked, *, stages: int, chunks: int) -> Stacked:
    """Undo `to_pipeline_order`: layers back in sequential order.

    **Arguments:** `stack` (in pipeline order); keyword-only `stages`, `chunks`.

    **Returns:** the stack with layer `i` at row `i`.

    ```python
    blocks = eqxpar.pipeline.from_pipeline_order(model.blocks, stages=4, chunks=2)
    ```
    """
    return _permute(stack, np.argsort(_permutation(_depth(stack), stages, chunks)))


def _depth(stack: Stacked) -> int:
    leaves = [x for x in jax.tree.leaves(stack.blocks) if eqx.is_array(x)]
    if not leaves:
        raise PlanError("the stack holds no arrays; nothing to reorder.")
    return int(leaves[0].shape[0])
