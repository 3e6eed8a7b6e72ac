"""Collectives tallied for `minimum_comm`: `Item`, a number of collectives of one
kind and size over named mesh axes, for one reason (`source`), and `sum_items`,
the tensor-parallel activation sums as such.
Shared with `eqxpar._advise` (which counts sums `minimum_comm` leaves out the
same way): internal names, not public API.
"""

import dataclasses
from typing import Any

from ._hlo import _ring_bytes
from ._jaxpr_walk import TensorSum

# Why a collective is needed: the `source` of an `Item` and of a `Cost`, which the
# advisor reads to know how eqxpar's implementation moves it.
GRADIENT_REDUCTION = "gradient reduction"
FSDP = "fsdp"
TENSOR_SUMS = "tensor sums"
PIPELINE_BOUNDARIES = "pipeline boundaries"
MOE_DISPATCH = "moe dispatch"
CONTEXT_KEYS_VALUES = "context keys and values"
CONTEXT_ALL_TO_ALL = "context all-to-all"


@dataclasses.dataclass(frozen=True)
class Item:
    """`repeat` collectives of one kind over `n` devices of mesh axes `axes`, each of
    `size` result bytes, needed for `source` (one of the constants above); `part` is the
    description the report prints."""

    part: str
    kind: str
    n: int
    size: int
    repeat: int = 1
    source: str = GRADIENT_REDUCTION
    axes: tuple[str, ...] = ()

    @property
    def result(self) -> int:
        return self.size * self.repeat if self.n > 1 or self.kind == "collective-permute" else 0

    @property
    def wire(self) -> int:
        if self.kind == "collective-permute":
            return self.size * self.repeat
        return self.repeat * _ring_bytes(self.kind, self.size, self.n)


def sum_items(
    sums: list[TensorSum],
    t: int,
    *,
    per_device: int,
    axis: str,
    repeat: tuple[int, int] = (1, 1),
    remat: Any = "none",
) -> list[Item]:
    """Activation all-reduces over `t` devices of the tensor axis `axis`: each sum's global bytes split
    `per_device` ways, repeated `count * repeat[0] // repeat[1]` times, and again where `remat`
    recomputes it. Under `"inputs"` each layer of a stack runs its forward again in its backward
    pass, but for its last sum (the layer's output, which its backward does not read): a forward
    sum inside a scan but the last runs twice. Under `"full"` the stack also recomputes its whole
    forward first (keeping each layer's input): every forward sum inside a scan runs once more.
    (Counted on compiled steps, XLA:CPU and the TPU compiler alike; `"dots"` keeps the sums.)"""
    num, den = repeat
    part = "tensor-parallel activation sums ({})"
    items = []
    for s in sums:
        runs = 1
        if s.where == "forward" and s.scanned:
            runs += (remat in ("inputs", "full") and not s.last) + (remat == "full")
        where = s.where if runs == 1 else f"{s.where}, {runs} runs"
        items.append(
            Item(
                part.format(where),
                "all-reduce",
                t,
                s.nbytes // per_device,
                runs * s.count * num // den,
                source=TENSOR_SUMS,
                axes=(axis,),
            )
        )
    return items
