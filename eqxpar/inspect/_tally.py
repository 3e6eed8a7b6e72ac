"""Collectives tallied for `minimum_comm`: `Item`, a number of collectives of one
kind and size, and `sum_items`, the tensor-parallel activation sums as such.
Shared with `eqxpar._advise` (which counts sums `minimum_comm` leaves out the
same way): internal names, not public API.
"""

import dataclasses

from ._hlo import _ring_bytes
from ._jaxpr_walk import TensorSum


@dataclasses.dataclass(frozen=True)
class Item:
    """`repeat` collectives of one kind over `n` devices, each of `size` result bytes."""

    part: str
    kind: str
    n: int
    size: int
    repeat: int = 1

    @property
    def result(self) -> int:
        return self.size * self.repeat if self.n > 1 or self.kind == "collective-permute" else 0

    @property
    def wire(self) -> int:
        if self.kind == "collective-permute":
            return self.size * self.repeat
        return self.repeat * _ring_bytes(self.kind, self.size, self.n)


def sum_items(
    sums: list[TensorSum], t: int, *, per_device: int, repeat: tuple[int, int] = (1, 1)
) -> list[Item]:
    """Activation all-reduces over `t` tensor devices: each sum's global bytes split
    `per_device` ways, repeated `count * repeat[0] // repeat[1]` times."""
    num, den = repeat
    part = "tensor-parallel activation sums ({})"
    return [
        Item(part.format(s.where), "all-reduce", t, s.nbytes // per_device, s.count * num // den)
        for s in sums
    ]
