"""Shared by the train step and plan-aware optimizers (`eqxpar.optim`): where the
arrays of the optimizer update live while a step runs it.

An optax transformation sees only arrays; inside `jax.jit` it cannot ask them how
they are split. A step publishes its mesh and the updates' specs (the layout's,
decided once by the `StepLayout`) for the time of `optimizer.update`, so a
transformation that must move whole matrices (Muon) can run its own collectives
on exactly the shards it is given, instead of leaving the compiler to gather them.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec
from jax.tree_util import keystr


@dataclasses.dataclass(frozen=True)
class UpdateLayout:
    """The mesh of a running update and each updated array's spec, keyed by the
    array's path in the parameter tree (`jax.tree_util.keystr`)."""

    mesh: Mesh
    specs: dict[str, PartitionSpec]

    @classmethod
    def of(cls, mesh: Mesh, specs: Any) -> "UpdateLayout":
        """From a pytree of PartitionSpecs mirroring the parameters (None elsewhere)."""
        flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
        return cls(mesh, {keystr(path): s for path, s in flat if isinstance(s, PartitionSpec)})

    def spec(self, path: tuple) -> PartitionSpec | None:
        """The spec of the array at `path` (a key path of a tree that mirrors the
        parameters, an optax-masked one included), or None when the step did not
        publish one there."""
        return self.specs.get(keystr(path))


_CURRENT: contextvars.ContextVar[UpdateLayout | None] = contextvars.ContextVar("eqxpar_update", default=None)


@contextlib.contextmanager
def updating(layout: UpdateLayout) -> Iterator[None]:
    """Publish `layout` for the optimizer update traced inside the block."""
    token = _CURRENT.set(layout)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_update_layout() -> UpdateLayout | None:
    """The layout of the optimizer update being traced, or None outside one (an
    update called by hand, or under no eqxpar step)."""
    return _CURRENT.get()
