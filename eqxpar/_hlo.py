"""Collective traffic read from compiled HLO text.

Counts each collective's *result* bytes (all-reduce: the full tensor; all-gather:
the gathered tensor; reduce-scatter: the shard; collective-permute: the moved
tensor; all-to-all: the tensor), per device. A collective inside a `while` body is
weighted by the loop's trip count (XLA records it as `known_trip_count`), nested
loops multiply, and computations called from several places count once per call.
"""

import dataclasses
import re
from collections import Counter
from typing import Any

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+(\([^)]*\)|\S).*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s+=\s+(.*?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_TRIP = re.compile(r"known_trip_count[^0-9]*(\d+)")
_CALLS = re.compile(r"\b(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass
class CollectiveStats:
    """Collective counts and result bytes by kind, per device."""

    count: Counter
    bytes: Counter

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"count": self.count[k], "bytes": self.bytes[k]} for k in KINDS if self.count[k]}


def shape_bytes(type_text: str) -> int:
    """Bytes of every array shape written in an HLO result type, e.g.
    `(f32[4,8]{1,0}, bf16[2])` -> 4*4*8 + 2*2."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _parse(text: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return computations, entry


def collective_stats(compiled_or_text: Any) -> CollectiveStats:
    """Collective counts and result bytes of a compiled computation, per device.

    **Arguments:**

    - `compiled_or_text`: a `jax.stages.Compiled` (or anything with `.as_text()`)
      or the HLO text itself.

    **Returns:** a `CollectiveStats` (`.count`, `.bytes` by kind, `.total_bytes`).
    """
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    computations, entry = _parse(text)
    count: Counter = Counter()
    nbytes: Counter = Counter()

    def visit(name: str, weight: int, depth: int) -> None:
        if depth > 64:
            raise ValueError("HLO call graph too deep (recursive computations?)")
        for line in computations.get(name, ()):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result_type, opcode = m.group(2), m.group(3)
            base = opcode.removesuffix("-start")
            if base in KINDS and not opcode.endswith("-done"):
                count[base] += weight
                # An async start's result is a tuple (operands, results[, scratch]);
                # the moved data is its result element.
                nbytes[base] += weight * (
                    _async_result_bytes(result_type)
                    if opcode.endswith("-start")
                    else shape_bytes(result_type)
                )
            inner = weight
            if opcode == "while":
                trip = _TRIP.search(line)
                inner = weight * (int(trip.group(1)) if trip else 1)
            if opcode == "fusion" or base in KINDS:
                # Fusions hold no collectives; reducers of collectives are scalars.
                continue
            for callee in _CALLS.findall(line):
                visit(callee, inner, depth + 1)
            for group in _BRANCHES.findall(line):
                for callee in group.split(","):
                    visit(callee.strip().lstrip("%"), inner, depth + 1)

    visit(entry, 1, 0)
    return CollectiveStats(count=count, bytes=nbytes)


def _async_result_bytes(result_type: str) -> int:
    # "((f32[8]), f32[64], ...)": take the second top-level element.
    depth, parts, start = 0, [], 1
    body = result_type.strip()
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:-1])
    return shape_bytes(parts[1]) if len(parts) > 1 else shape_bytes(body)
