"""Turn what the inspection reports accept (a Step and its arguments, a Lowered, a
Compiled, from `jax.jit` or `eqx.filter_jit`) into one compiled executable."""

from typing import Any

import jax

from .._errors import EqxparError
from .._text import short
from .._train._step import Step

_ACCEPTED = (
    "an eqxpar Step (from eqxpar.train.make_step) followed by (state, batch), or a "
    "compiled or lowered computation: jax.jit(f).lower(x).compile(), "
    "eqx.filter_jit(f).lower(x).compile(), or either without .compile()"
)


def unwrap_stage(target: Any) -> Any:
    """The `jax.stages.Lowered` / `Compiled` inside Equinox's wrappers, else `target`.

    `eqx.filter_jit(f).lower(...)` returns Equinox's own `Lowered` (its jax one in
    `.lowered`), and its `.compile()` an Equinox `Compiled` (in `.compiled`); their
    `as_text()` is missing or is the pre-partitioning StableHLO, so the reports
    read the jax object instead. Found by attribute, not by Equinox's private
    class names.
    """
    if isinstance(target, jax.stages.Lowered | jax.stages.Compiled):
        return target
    for attr in ("compiled", "lowered"):
        inner = getattr(target, attr, None)
        if isinstance(inner, jax.stages.Lowered | jax.stages.Compiled):
            return inner
    return target


def compiled_stage(target: Any) -> jax.stages.Compiled | None:
    """The compiled executable of a jax or Equinox `Lowered` / `Compiled`
    (compiling a Lowered: collectives exist only after XLA partitions the
    program), or None for anything else."""
    stage = unwrap_stage(target)
    if isinstance(stage, jax.stages.Lowered):
        return stage.compile()
    return stage if isinstance(stage, jax.stages.Compiled) else None


def as_compiled(target: Any, args: tuple[Any, ...], *, where: str) -> tuple[jax.stages.Compiled, Step | None]:
    """`(compiled, step)`: the executable of `target`, and the step it came from
    (None when a Lowered or Compiled was given)."""
    if isinstance(target, Step):
        if len(args) != 2:
            raise EqxparError(
                f"{where}(step, *args): a Step is compiled for (state, batch), so it takes "
                f"exactly 2 more arguments, got {len(args)}. Call {where}(step, state, batch)."
            )
        return target.compile(*args), target
    stage = unwrap_stage(target)
    if not isinstance(stage, jax.stages.Lowered | jax.stages.Compiled):
        raise EqxparError(
            f"{where}({type(target).__name__} {short(target)}): expected {_ACCEPTED}. Pass one of those."
        )
    if args:
        raise EqxparError(
            f"{where}({type(target).__name__}, ...): an already lowered or compiled "
            f"computation takes no further arguments, got {len(args)}. Drop them, or "
            f"pass the eqxpar Step instead: {where}(step, state, batch)."
        )
    return compiled_stage(stage), None
