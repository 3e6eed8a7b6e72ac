"""The parts of optax's Muon (`optax.contrib`) that `eqxpar.optim.muon` reuses,
imported in one place with the version that has them checked.

eqxpar's Muon must give `optax.contrib.muon`'s numbers, so it runs optax's own
Newton–Schulz iteration and shape scaling on each whole matrix rather than a copy
of them. Those live in optax's `contrib._muon` module; its arguments
(`preconditioning`, `consistent_rms`, `adam_learning_rate`, presets by name) are
those of optax 0.2.8, the oldest release this is written against.
"""

import importlib.metadata
from typing import Any

from .._errors import EqxparError

MIN_OPTAX = (0, 2, 8)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_optax() -> None:
    """Raise unless the installed optax has the Muon this module reuses."""
    installed = importlib.metadata.version("optax")
    if _version(installed) < MIN_OPTAX:
        raise EqxparError(
            f"eqxpar.optim.muon needs optax >= {'.'.join(map(str, MIN_OPTAX))} (its optax.contrib.muon "
            f"arguments and Newton-Schulz iteration), but optax {installed} is installed. Upgrade: "
            "pip install -U 'optax>=0.2.8'."
        )


def optax_muon() -> Any:
    """optax's Muon module (`optax.contrib._muon`: `orthogonalize_via_newton_schulz`,
    `scale_by_shape`, the named coefficient presets), after the version check.
    Imported when a Muon is built, never when eqxpar is: an older optax keeps
    every other part of eqxpar working."""
    check_optax()
    from optax.contrib import _muon

    return _muon
