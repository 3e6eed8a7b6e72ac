"""Rematerialisation over named activations, and what a plan keeps in host memory.

Shared by the plan (which checks `Plan(remat=..., offload=...)`) and the layers
(`eqxpar.nn`, which name their intermediates and build the checkpoint policy), so
it imports nothing of either.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from ._errors import PlanError

#: What `Plan(offload=...)` can keep in host memory: the optimizer state, the
#: parameters, the activations a `RematPolicy` names as offloaded.
OFFLOAD_PARTS = ("optimizer", "params", "activations")

#: The names eqxpar's layers give their intermediate values (`name_activation`),
#: MaxText's where one fits: each block's input, the attention's query, key and
#: value projections (`qkv_proj` when stored as one weight) and its output
#: projection, the MLP's input projection (its hidden state before the
#: activation) and its output projection.
ACTIVATION_NAMES = (
    "decoder_layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
    "qkv_proj",
    "out_proj",
    "mlpwi",
    "mlpwo",
)


def name_activation(x: Any, name: str) -> Any:
    """`x`, named `name` for a `RematPolicy` (`jax.ad_checkpoint.checkpoint_name`).
    The name is an identity that lowers to nothing: a program whose policy does
    not mention it compiles to the same HLO as without it."""
    return checkpoint_name(x, name)


@dataclasses.dataclass(frozen=True, init=False)
class RematPolicy:
    """A rematerialisation policy over the named activations of eqxpar's layers
    (`Plan(remat=RematPolicy(...))`): per block of a scanned stack, the values
    named in `saved` are kept on the device for the backward pass, those in
    `offloaded` are copied to host memory in the forward pass and back in the
    backward pass (with `Plan(offload=("activations",))`), and everything else
    is recomputed.

    **Arguments:**

    - `saved`: names (from `ACTIVATION_NAMES`) kept on the device.
    - `offloaded`: names moved to host memory (`"pinned_host"`); needs
      `"activations"` among the plan's `offload`.

    MaxText's `qkv_proj_offloaded` is `RematPolicy(offloaded=("query_proj",
    "key_proj", "value_proj"))`, its `save_qkv_proj` `RematPolicy(saved=(...))`
    of the same names.

    ```python
    policy = eqxpar.RematPolicy(offloaded=("query_proj", "key_proj", "value_proj"))
    plan = eqxpar.Plan(mesh, remat=policy, offload=("activations",))
    ```
    """

    saved: tuple[str, ...]
    offloaded: tuple[str, ...]

    def __init__(self, *, saved: Any = (), offloaded: Any = ()):
        checked = {
            what: _checked_names(value, what) for what, value in (("saved", saved), ("offloaded", offloaded))
        }
        both = sorted(set(checked["saved"]) & set(checked["offloaded"]))
        if both:
            raise PlanError(
                f"RematPolicy(saved=..., offloaded=...): {both} are in both; a value is kept either on "
                "the device or in host memory. Name each in one of them."
            )
        object.__setattr__(self, "saved", checked["saved"])
        object.__setattr__(self, "offloaded", checked["offloaded"])

    def checkpoint_policy(self) -> Callable:
        """The `jax.checkpoint` policy: `save_only_these_names` without offloaded
        names, else `save_and_offload_only_these_names` from device to pinned host."""
        if not self.offloaded:
            return jax.checkpoint_policies.save_only_these_names(*self.saved)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(self.saved),
            names_which_can_be_offloaded=list(self.offloaded),
            offload_src="device",
            offload_dst="pinned_host",
        )


def _checked_names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
        raise PlanError(
            f"RematPolicy({what}={value!r}): expected a sequence of activation names, some of {ACTIVATION_NAMES}."
        )
    unknown = [v for v in value if v not in ACTIVATION_NAMES]
    if unknown:
        raise PlanError(
            f"RematPolicy({what}={tuple(value)!r}): {unknown} name no activation of eqxpar's layers; "
            f"expected some of {ACTIVATION_NAMES}."
        )
    return tuple(dict.fromkeys(value))


def checked_offload(offload: Any, remat: Any) -> tuple[str, ...]:
    """`Plan(offload=...)` as a tuple of `OFFLOAD_PARTS`, checked against the
    plan's `remat` (activations go to the host only by a `RematPolicy` that
    names some as offloaded, and such a policy needs them allowed)."""
    if offload is None:
        offload = ()
    if isinstance(offload, str):
        offload = (offload,)
    if not isinstance(offload, (tuple, list)) or not all(isinstance(v, str) for v in offload):
        raise PlanError(f"Plan(offload={offload!r}): expected a sequence of some of {OFFLOAD_PARTS}.")
    unknown = [v for v in offload if v not in OFFLOAD_PARTS]
    if unknown:
        raise PlanError(
            f"Plan(offload={tuple(offload)!r}): {unknown} unknown; expected some of {OFFLOAD_PARTS}."
        )
    parts = tuple(p for p in OFFLOAD_PARTS if p in offload)
    offloads_names = isinstance(remat, RematPolicy) and bool(remat.offloaded)
    if "activations" in parts and not offloads_names:
        raise PlanError(
            f"Plan(offload={parts!r}, remat={remat!r}): 'activations' offloads the activations the remat "
            "policy names as offloaded, and this one names none. Pass remat=eqxpar.RematPolicy("
            "offloaded=(...)) with some of " + f"{ACTIVATION_NAMES}, or drop 'activations'."
        )
    if offloads_names and "activations" not in parts:
        raise PlanError(
            f"Plan(remat={remat!r}) offloads {remat.offloaded} to host memory, which the plan does not allow: "
            "add 'activations' to Plan(offload=...), or move those names to RematPolicy(saved=...)."
        )
    return parts
