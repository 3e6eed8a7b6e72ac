"""Turn what the inspection reports accept (a Step and its arguments, a Lowered, a
Compiled) into one compiled executable."""

from typing import Any

import jax

from ._errors import EqxparError
from ._step import Step
from ._text import short


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
    if isinstance(target, jax.stages.Lowered | jax.stages.Compiled):
        if args:
            raise EqxparError(
                f"{where}({type(target).__name__}, ...): an already lowered or compiled "
                f"computation takes no further arguments, got {len(args)}. Drop them, or "
                f"pass the eqxpar Step instead: {where}(step, state, batch)."
            )
        compiled = target.compile() if isinstance(target, jax.stages.Lowered) else target
        return compiled, None
    raise EqxparError(
        f"{where}({type(target).__name__} {short(target)}): expected an eqxpar Step (from "
        "eqxpar.train.make_step) followed by (state, batch), or a jax.stages.Compiled / "
        f"Lowered (e.g. jax.jit(f).lower(x).compile()). Pass one of those."
    )
