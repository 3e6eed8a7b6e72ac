"""Logical axis names stored on Equinox fields."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx

from ._errors import SpecError

# The metadata key under which a field's logical axis names live. Equinox keeps
# field metadata on the class, so every pytree that reuses the model's module
# classes (gradients, optax moments) carries the same names for free.
AXES_KEY = "eqxpar_axes"
# The metadata key of a field holding a stack of identical sub-modules (every array
# below it has extra leading dimensions, e.g. one per layer or pipeline stage).
LEADING_KEY = "eqxpar_leading_axes"


def param(*, axes: Any, **field_kwargs: Any) -> Any:
    """Declare a module field as a weight with logical axis names.

    A thin wrapper over `eqx.field(metadata=...)`: the names say what each dimension
    *means* ("embed", "mlp", "heads", "vocab"; `None` for a dimension that is never
    split). A plan's rules turn them into mesh axes as late as possible, so the same
    module runs under every strategy.

    **Arguments:**

    - `axes`: one logical name (or `None`) per dimension of the weight.
    - `field_kwargs`: forwarded to `eqx.field` (e.g. `converter`).

    **Returns:** a dataclass field for an `eqx.Module` class body.

    ```python
    class ColumnLinear(eqx.Module):
        weight: Float[Array, "d_in d_out"] = eqxpar.param(axes=("embed", "mlp"))
    ```
    """
    # A bare string would be taken letter by letter.
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise SpecError(
            f"eqxpar.param(axes={axes!r}): expected a tuple with one logical axis name (str) or None "
            f"per dimension of the weight, e.g. axes=({axes!r},) for a vector."
        )
    axes = tuple(axes)
    for name in axes:
        if name is not None and not isinstance(name, str):
            raise SpecError(
                f"eqxpar.param(axes={axes!r}): every entry must be a logical axis name "
                f"(str) or None, got {name!r}."
            )
    metadata = dict(field_kwargs.pop("metadata", {}))
    metadata[AXES_KEY] = axes
    return eqx.field(metadata=metadata, **field_kwargs)


def field_axes(module: eqx.Module, name: str) -> tuple[str | None, ...] | None:
    """The logical axes declared on field `name` of `module`, or None."""
    fields = getattr(type(module), "__dataclass_fields__", {})
    field = fields.get(name)
    if not isinstance(field, dataclasses.Field):
        return None
    return field.metadata.get(AXES_KEY)


def stacked(*, leading: Any) -> Any:
    """Declare a module field that holds a *stack* of identical sub-modules.

    Every array below the field has `len(leading)` extra leading dimensions (one
    per layer of a scanned stack, or per pipeline stage); their logical names are
    `leading`, prepended to the names the sub-modules declare, so rules see e.g.
    `("layers", "embed", "mlp")`. `eqxpar.nn.Stacked` uses `("layers",)`.

    **Arguments:**

    - `leading`: one logical name per leading dimension.

    **Returns:** a dataclass field for an `eqx.Module` class body.

    ```python
    class Stages(eqx.Module):
        blocks: Block = eqxpar.stacked(leading=("stage",))
    ```
    """
    if isinstance(leading, str) or not isinstance(leading, Sequence):
        raise SpecError(f"eqxpar.stacked(leading={leading!r}): expected a tuple of logical axis names (str).")
    leading = tuple(leading)
    if not leading or not all(isinstance(name, str) for name in leading):
        raise SpecError(
            f"eqxpar.stacked(leading={leading!r}): expected one or more logical axis names (str)."
        )
    return eqx.field(metadata={LEADING_KEY: leading})


def field_leading(module: eqx.Module, name: str) -> tuple[str, ...]:
    """The leading logical axes declared with `stacked` on field `name`, or ()."""
    fields = getattr(type(module), "__dataclass_fields__", {})
    field = fields.get(name)
    if not isinstance(field, dataclasses.Field):
        return ()
    return tuple(field.metadata.get(LEADING_KEY, ()))
