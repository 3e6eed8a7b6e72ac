"""Checks shared by the layer configs (`AttentionConfig`, `MoEConfig`,
`BlockConfig`): each error names the config's fields it refuses, so that a config
built from another one's fields (`eqxpar.models.GPTConfig`) can re-raise it under
its own field names."""

import math
from collections.abc import Mapping

from ._errors import EqxparError, PlanError


def field_error(error: type[EqxparError], owner: str, detail: str, **fields: object) -> EqxparError:
    """`error("owner(name=value, ...): detail")`, the fields and detail kept on it
    (as `fields`, `detail`) for `renamed`."""
    err = error(f"{owner}({_spell(fields)}): {detail}")
    err.fields, err.detail = fields, detail  # type: ignore[attr-defined]
    return err


def renamed(err: EqxparError, owner: str, names: Mapping[str, str]) -> EqxparError:
    """`err` (from `field_error`) as `owner` reports it: each field `f` spelled
    `names.get(f, f)`, the same error type and detail. An error without fields
    comes back as it is."""
    fields = getattr(err, "fields", None)
    if fields is None:
        return err
    spelled = {names.get(name, name): value for name, value in fields.items()}
    return field_error(type(err), owner, err.detail, **spelled)  # type: ignore[attr-defined]


def _spell(fields: Mapping[str, object]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in fields.items())


def is_int(value: object) -> bool:
    # bool is an int subclass, so num_heads=True would otherwise pass as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """`value` is an integer >= 1 (or None, when `optional`)."""
    if optional and value is None:
        return
    if not (is_int(value) and value >= 1):
        hint = ", or None" if optional else ""
        raise field_error(PlanError, owner, f"expected a positive integer{hint}.", **{name: value})


def check_bool(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """`value` is True or False (or None, when `optional`)."""
    if optional and value is None:
        return
    if not isinstance(value, bool):
        expected = "True, False or None" if optional else "True or False"
        raise field_error(PlanError, owner, f"expected {expected}.", **{name: value})


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """`value` is one of `choices`."""
    if value not in choices:
        spelled = " or ".join(", ".join(repr(c) for c in choices).rsplit(", ", 1))
        raise field_error(PlanError, owner, f"expected {spelled}.", **{name: value})


def is_positive_finite(value: object) -> bool:
    """A number (not a bool) that is finite and > 0."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return numeric and math.isfinite(value) and value > 0  # type: ignore[arg-type]


def check_rate(owner: str, name: str, value: object) -> None:
    """`value` is a dropout rate: a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) < 1.0:
        raise field_error(
            PlanError, owner, "expected a rate in [0, 1) (0: no dropout), e.g. 0.1.", **{name: value}
        )
