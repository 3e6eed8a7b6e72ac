"""How much collective traffic a compiled program's schedule overlaps with compute.

A scheduled HLO module (`compiled.as_text()` of a TPU or GPU executable; its
`HloModule` line says `is_scheduled=true`) lists each computation's instructions
in the order they run. An asynchronous collective is a start and a done
(`all-gather-start` ... `all-gather-done`, `all-reduce-start`/`-done`,
`collective-permute-start`/`-done`, or `async-start`/`async-done` around a called
computation holding e.g. a `reduce-scatter` or an `all-to-all`); what the schedule
puts between the two runs while the data moves.

A collective counts as *overlapped* when at least one instruction of real work
stands between its start and its done, in the same computation:

- work: a fusion, a custom-call, a convolution or dot, any other unfused
  operation (an elementwise op, a copy, a dynamic-slice, a reduce...), and a
  `while`, `call` or `conditional` whose computations hold work;
- not work: `parameter`, `constant`, `get-tuple-element`, `tuple`, `bitcast`,
  `partition-id`, `replica-id`, `after-all`, `add-dependency`, `opt-barrier`,
  other asynchronous starts, updates and dones (another collective's, a
  `copy-start`'s memory transfer, a `call-start`'s offloaded call), and synchronous
  collectives (communication, not compute).

A synchronous collective (no start and done) is never overlapped, nor is a start
whose done the computation does not hold. Bytes are `collective_stats`'s wire
bytes, weighted the same way (loop trip counts, a conditional's heaviest branch,
the busiest device's collective-permutes), so the overlapped bytes are those of
the same walk counting only the overlapped collectives.
"""

import dataclasses
import re
from typing import Any

from .._text import fmt_int, render
from ._hlo import (
    _BRANCHES,
    _CALLS,
    _CONDITIONAL,
    _INSTRUCTION,
    KINDS,
    _module_devices,
    _parse,
    _Walk,
    walk_tally,
)
from ._hlo import _hlo_text as hlo_text

_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=")
_OPERAND = re.compile(r"%([\w.\-]+)")
# Starts of asynchronous work around a called computation (not a collective kind).
_WRAPPERS = ("async-start", "call-start")
_NOT_WORK = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "partition-id",
        "replica-id",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "domain",
        *KINDS,
    }
)


@dataclasses.dataclass(frozen=True)
class OverlapStats:
    """Collective wire bytes per device (as `collective_stats` counts them) and the
    part of them the schedule overlaps with compute (see the module docstring).

    - `async_wire_bytes`: wire bytes of the collectives with work between their
      start and done.
    - `wire_bytes`: wire bytes of all collectives.
    - `by_kind`: `{kind: (async wire bytes, wire bytes)}` for each kind that moves
      any.

    `share` is `async_wire_bytes / wire_bytes`, 0.0 for a program that moves
    nothing; `kind_share(kind)` the same for one kind. `str(stats)` is a
    plain-text table.

    ```python
    stats = eqxpar.inspect.overlap_stats(compiled)
    stats.share  # e.g. 0.93: 93% of the wire bytes move behind compute
    stats.by_kind["all-gather"]  # e.g. (1048576, 1048576)
    ```
    """

    async_wire_bytes: int
    wire_bytes: int
    by_kind: dict[str, tuple[int, int]]

    @property
    def share(self) -> float:
        """The overlapped part of the wire bytes, 0.0 when there are none."""
        return self.async_wire_bytes / self.wire_bytes if self.wire_bytes else 0.0

    def kind_share(self, kind: str) -> float:
        """The overlapped part of one kind's wire bytes, 0.0 when it moves none."""
        overlapped, total = self.by_kind.get(kind, (0, 0))
        return overlapped / total if total else 0.0

    def __str__(self) -> str:
        rows = [
            [kind, fmt_int(a), fmt_int(t), f"{self.kind_share(kind):.1%}"]
            for kind, (a, t) in self.by_kind.items()
        ]
        rows.append(["total", fmt_int(self.async_wire_bytes), fmt_int(self.wire_bytes), f"{self.share:.1%}"])
        header = ["collective", "overlapped wire bytes", "wire bytes", "share"]
        return "collectives overlapped with compute, per device\n" + render(
            header, rows, right=[False, True, True, True]
        )


def overlap_stats(compiled_or_text: Any, num_devices: int | None = None) -> OverlapStats:
    """The collective wire bytes of a compiled computation that its schedule runs
    asynchronously with compute, beside all of them, per device.

    **Arguments:**

    - `compiled_or_text`: what `collective_stats` accepts (a compiled or lowered
      computation, anything whose `.as_text()` is compiled HLO, or the text). Only
      a scheduled module says what overlaps: a CPU executable's collectives are
      synchronous, so its share is 0.
    - `num_devices`: as for `collective_stats` (the group size of a collective
      with empty `replica_groups`, where the `HloModule` line does not say it).

    **Returns:** an `OverlapStats` (`.async_wire_bytes`, `.wire_bytes`, `.by_kind`,
    `.share`).

    **Raises:** `EqxparError` (a `ValueError`) where `collective_stats` does.

    ```python
    compiled = jax.jit(step).lower(state, batch).compile()  # for a TPU topology
    print(eqxpar.inspect.overlap_stats(compiled))  # all-gather  ...  97.0%
    ```
    """
    text = hlo_text(compiled_or_text)
    computations, entry = _parse(text)
    if num_devices is None:
        num_devices = _module_devices(text)
    overlapped, wrapped = _schedule(computations)
    total = walk_tally(_Walk(computations, num_devices), entry).wire
    part = walk_tally(_OverlapWalk(computations, num_devices, overlapped, wrapped), entry).wire
    by_kind = {k: (int(part[k]), int(total[k])) for k in KINDS if total[k]}
    return OverlapStats(sum(a for a, _ in by_kind.values()), sum(t for _, t in by_kind.values()), by_kind)


@dataclasses.dataclass(frozen=True)
class _OverlapWalk(_Walk):
    """`collective_stats`'s walk, counting only the overlapped collectives: the
    `-start`s in `overlapped`, and the collectives of computations called by an
    asynchronous wrapper (`wrapped`), which the walk enters only from the
    overlapped wrappers."""

    overlapped: frozenset[str] = frozenset()
    wrapped: frozenset[str] = frozenset()

    def counts(self, computation: str, line: str, opcode: str) -> bool:
        if opcode.endswith("-start"):
            return _name(line) in self.overlapped
        return computation in self.wrapped

    def descends(self, line: str, opcode: str) -> bool:
        return opcode not in _WRAPPERS or _name(line) in self.overlapped


def _name(line: str) -> str:
    m = _NAME.match(line)
    return m.group(1) if m else ""


def _schedule(computations: dict[str, list[str]]) -> tuple[frozenset[str], frozenset[str]]:
    """The names of the asynchronous starts (collectives and wrappers) with work
    before their done, and the computations the wrappers call."""
    work = _Work(computations, {})
    overlapped: set[str] = set()
    wrapped: set[str] = set()
    for lines in computations.values():
        pending: dict[str, bool] = {}  # start name -> work seen since
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            opcode = m.group(3)
            if opcode.endswith("-start") and (opcode.removesuffix("-start") in KINDS or opcode in _WRAPPERS):
                pending[_name(line)] = False
                if opcode in _WRAPPERS:
                    wrapped.update(_CALLS.findall(line))
            elif opcode.endswith("-done"):
                operand = _OPERAND.search(m.group(4))
                if operand and pending.pop(operand.group(1), False):
                    overlapped.add(operand.group(1))
            elif pending and work.instruction(opcode, line):
                pending = dict.fromkeys(pending, True)
    return frozenset(overlapped), frozenset(wrapped)


@dataclasses.dataclass(frozen=True)
class _Work:
    """Which instructions are real work (the module docstring's rule), with the
    answer for each called computation remembered."""

    computations: dict[str, list[str]]
    known: dict[str, bool]

    def instruction(self, opcode: str, line: str) -> bool:
        if opcode in _NOT_WORK or opcode.endswith(("-start", "-update", "-done")):
            return False
        if opcode not in ("while", "call", "conditional"):
            return True
        callees = _CALLS.findall(line) + _CONDITIONAL.findall(line)
        callees += [c.strip().lstrip("%") for group in _BRANCHES.findall(line) for c in group.split(",")]
        return any(self.computation(c) for c in callees)

    def computation(self, name: str) -> bool:
        if name not in self.known:
            self.known[name] = False  # a recursive call holds no more work than itself
            self.known[name] = any(
                self.instruction(m.group(3), line)
                for line in self.computations.get(name, ())
                if (m := _INSTRUCTION.match(line))
            )
        return self.known[name]
