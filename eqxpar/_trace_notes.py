"""Outlines that layers note while a function is traced, for analyses that read
a loss's computation without compiling it (`eqxpar.inspect.minimum_comm`, the
plan advisor): the attention keys of context parallelism, the routed
activations of mixture-of-experts layers."""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax


class TraceNotes:
    """A list that layers append array outlines to while a trace runs inside
    `record()`; outside it, `note` does nothing."""

    def __init__(self, name: str):
        self._seen: contextvars.ContextVar[list[jax.ShapeDtypeStruct] | None] = contextvars.ContextVar(
            name, default=None
        )

    @contextlib.contextmanager
    def record(self) -> Iterator[list[jax.ShapeDtypeStruct]]:
        """Collect the outlines noted inside the block, in order."""
        seen: list[jax.ShapeDtypeStruct] = []
        token = self._seen.set(seen)
        try:
            yield seen
        finally:
            self._seen.reset(token)

    def note(self, x: Any) -> None:
        """Append the outline (shape, dtype) of `x` when recording."""
        seen = self._seen.get()
        if seen is not None:
            seen.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
