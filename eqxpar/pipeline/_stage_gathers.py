"""Where a pipeline stage gathers its FSDP-split weights under
`Plan(stage_gradients="sharded")`: at each use, not once per step.

The engine's default gathers every weight split over the batch axes once, before
the schedule's loops, and reduce-scatters its gradient sum once, after them: the
least traffic, but a device then holds its stage's weights and float32 gradient
sums whole for the step (Llama-3-70B over pipe 4 x fsdp 32: 20 layers of 0.86 B
parameters, 69 GB of sums per chip). Here the weights stay shards: the stage's
`first` / `last` weights (the rest of the model) are gathered whole inside the
stage function of each action that runs them, and the stack's a layer at a time
inside its scan (`eqxpar.nn.Stacked` reads the per-layer gathers registered with
`layer_gathers`), so one layer's weights are whole at a time. Autodiff transposes
each gather into a reduce-scatter: every action's gradients arrive split like the
weights, and are summed into split accumulators.
"""

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._fsdp import Gather, gather_weights, gathers_of
from .._varying import mark_varying, varying_axes


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A leaf's spec held as one pytree leaf (a PartitionSpec is a tuple, which
    `jax.tree` would walk into)."""

    spec: PartitionSpec | None


@dataclasses.dataclass(frozen=True)
class _Whole:
    """A leaf's gather whole, as one pytree leaf."""

    gather: Gather


class StageGathers:
    """The gathers of one device's weights at their uses.

    - `params`: the device's floating-point weights (None elsewhere), shards.
    - `specs`: their specs (mirroring `params`).
    - `blocks_of`: the pipelined stack's blocks in a tree like `params`.
    - `axes`: the manual batch axes of size > 1 the weights may be split over.
    - `unsplit`: the mesh's size-1 axes (`gathers_of`).
    """

    def __init__(
        self, params: Any, specs: Any, blocks_of: Any, axes: Collection[str], *, unsplit: Collection[str] = ()
    ):
        wrapped = jax.tree.map(
            lambda x, spec: None if x is None else _Spec(spec), params, specs, is_leaf=lambda x: x is None
        )
        blocks = blocks_of(wrapped)
        rest = eqx.tree_at(blocks_of, wrapped, jax.tree.map(lambda _: None, blocks))
        where = "a weight under Plan(stage_gradients='sharded')"
        #: Mirrors the rest of the model (the stack's blocks None): each leaf's
        #: gather whole.
        self.rest = jax.tree.map(
            lambda s: None if s is None else _Whole(gathers_of(s.spec, axes, where=where, unsplit=unsplit)),
            rest,
            is_leaf=lambda x: x is None or isinstance(x, _Spec),
        )
        #: Per leaf of the blocks (in `jax.tree.leaves` order): one layer's gather.
        self.layer = [
            gathers_of(s.spec, axes, skip=1, where=where, unsplit=unsplit) for s in jax.tree.leaves(blocks)
        ]

        #: Per leaf of the rest (in `jax.tree.leaves` order): whether `first` and
        #: whether `last` uses it (`find_uses`); None: not found yet (all are).
        self.used: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None

    def whole_outlines(self, rest: Any) -> Any:
        """The outlines of `rest` (shards) gathered whole."""

        def whole(g: _Whole | None, x: Any) -> Any:
            if x is None:
                return x
            shape = x.shape if g is None else self._whole_shape(x, g)
            return jax.ShapeDtypeStruct(shape, x.dtype)

        return jax.tree.map(whole, self.rest, rest, is_leaf=lambda x: x is None or isinstance(x, _Whole))

    def find_uses(self, whole: Any, first: Callable[[Any], Any], last: Callable[[Any], Any]) -> None:
        """Record which leaves of the rest `first` and `last` read (each a function
        of the whole rest, outlines `whole`): a stage gathers only those of the
        ends it runs. Found from the functions' jaxprs: an input no equation
        reads is not used."""

        def reads(fn: Callable[[Any], Any]) -> tuple[bool, ...]:
            closed = jax.make_jaxpr(fn)(whole)
            used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
            used |= {id(v) for v in closed.jaxpr.outvars}
            return tuple(id(v) in used for v in closed.jaxpr.invars)

        self.used = (reads(first), reads(last))

    def gather_rest(self, rest: Any, *, first: bool, last: bool) -> tuple[Any, list[Any]]:
        """`rest` (the model's weights outside the stack, shards) gathered whole
        where the stage's ends (`first`, `last`) read them, zeros of the whole
        shape elsewhere (XLA removes them: nothing reads them); and the gathered
        arrays (residuals a stage forward need not store: its backward gathers
        them again)."""
        gathered: list[Any] = []
        leaves = jax.tree.leaves(rest)
        wanted = [
            self.used is None or (first and self.used[0][i]) or (last and self.used[1][i])
            for i in range(len(leaves))
        ]
        index = iter(range(len(leaves)))

        def gather(g: _Whole | None, x: Any) -> Any:
            if x is None:
                return x
            i = next(index)
            if g is None or not g.gather:
                return x
            if not wanted[i]:
                axes = varying_axes(x)
                return mark_varying(jnp.zeros(self._whole_shape(x, g), x.dtype), axes)
            out = gather_weights(x, g.gather)
            gathered.append(out)
            return out

        out = jax.tree.map(gather, self.rest, rest, is_leaf=lambda x: x is None or isinstance(x, _Whole))
        return out, gathered

    @staticmethod
    def _whole_shape(x: Any, g: _Whole) -> tuple[int, ...]:
        shape = list(x.shape)
        for dim, axes in g.gather:
            shape[dim] *= math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
        return tuple(shape)

    def per_layer(self, chunk: Any, static_blocks: Any) -> dict[int, Gather]:
        """For `eqxpar._fsdp.layer_gathers`: each array of a stage's stack (its
        chunk of weights `chunk`, and the stack's non-floating arrays
        `static_blocks`, never gathered) by identity, and how one layer of it is
        gathered."""
        leaves = jax.tree.leaves(chunk)
        if len(leaves) != len(self.layer):
            raise AssertionError(f"{len(leaves)} stage weights for {len(self.layer)} gathers")
        out = {id(x): g for x, g in zip(leaves, self.layer, strict=True)}
        out.update({id(x): () for x in jax.tree.leaves(static_blocks) if eqx.is_array(x)})
        return out
