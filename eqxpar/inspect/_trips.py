"""A `while` loop's trip count read from its condition, body and initial value,
for compiled HLO that does not write `known_trip_count` (a TPU executable's, e.g.
libtpu 0.0.50's scanned layers and windowed einsums).

It recognises the counted loop XLA leaves behind: the condition's root compares a
loop-carried integer (`get-tuple-element(param), index=i`, or a copy of it) with a
constant (`direction=LT`, `LE`, `GT`, `GE` or `NE`), the body's root tuple sets
element `i` to that element plus (or minus) a constant step, and the loop's
operand is a `tuple` whose element `i` is a constant (or a copy of one). Anything
else (a bound read from data, a step that is not a constant, an operand built
another way) is not guessed at: the answer is None and the reader counts the body
once, as it does for a loop with no known count.
"""

import math
import re

_OPERANDS = re.compile(r"%([\w.\-]+)")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+.*?\s+([\w\-]+)\((.*)$")
_INDEX = re.compile(r"\bindex=(\d+)")
_CONSTANT = re.compile(r"\bconstant\((-?\d+)\)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def _defs(lines: list[str]) -> dict[str, tuple[str, str, str]]:
    """name -> (opcode, text after `opcode(`, whole line), and `ROOT` -> the root's."""
    found = {}
    for line in lines:
        m = _DEF.match(line)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3), line)
            if line.lstrip().startswith("ROOT"):
                found["ROOT"] = found[m.group(1)]
    return found


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction: the `%name`s before its operand list closes."""
    return _OPERANDS.findall(rest.split(")", 1)[0])


def _through_copies(defs: dict, name: str) -> tuple[str, str, str]:
    """The definition of `name`, or of what it copies where it is a copy (or a
    bitcast) of another value: XLA copies a loop's counter in and out of the loop."""
    for _ in range(16):
        opcode, rest, line = defs.get(name, ("", "", ""))
        if opcode not in ("copy", "bitcast") or not _operands(rest):
            return opcode, rest, line
        name = _operands(rest)[0]
    return "", "", ""


def _constant(defs: dict, name: str) -> int | None:
    """The integer `name` holds where it is a constant (or a copy of one)."""
    opcode, _, line = _through_copies(defs, name)
    m = _CONSTANT.search(line) if opcode == "constant" else None
    return int(m.group(1)) if m else None


def _element(defs: dict, name: str) -> int | None:
    """i where `name` is (a copy of) `get-tuple-element(<the parameter>), index=i`."""
    opcode, rest, line = _through_copies(defs, name)
    if opcode != "get-tuple-element":
        return None
    source = defs.get(_operands(rest)[0] if _operands(rest) else "", ("",))[0]
    m = _INDEX.search(line)
    return int(m.group(1)) if m and source == "parameter" else None


def _bound(condition: list[str]) -> tuple[int, str, int] | None:
    """(element index, direction, bound) of `element <direction> bound`."""
    defs = _defs(condition)
    opcode, rest, line = defs.get("ROOT", ("", "", ""))
    direction = _DIRECTION.search(line)
    names = _operands(rest)
    if opcode != "compare" or direction is None or len(names) != 2:
        return None
    a, b = names
    if _element(defs, a) is not None and _constant(defs, b) is not None:
        return _element(defs, a), direction.group(1), _constant(defs, b)
    if _element(defs, b) is not None and _constant(defs, a) is not None:
        return _element(defs, b), _FLIP[direction.group(1)], _constant(defs, a)
    return None


def _step(body: list[str], index: int) -> int | None:
    """The constant the body adds to element `index` (negative for a subtract)."""
    defs = _defs(body)
    opcode, rest, _ = defs.get("ROOT", ("", "", ""))
    names = _operands(rest)
    if opcode != "tuple" or index >= len(names):
        return None
    op, inner, _ = defs.get(names[index], ("", "", ""))
    args = _operands(inner)
    if op not in ("add", "subtract") or len(args) != 2:
        return None
    a, b = args
    if _element(defs, a) == index and _constant(defs, b) is not None:
        return _constant(defs, b) * (-1 if op == "subtract" else 1)
    if op == "add" and _element(defs, b) == index and _constant(defs, a) is not None:
        return _constant(defs, a)
    return None


def _count(start: int, direction: str, bound: int, step: int) -> int | None:
    if direction in ("GT", "GE"):  # counting down: the same loop mirrored
        start, bound, step, direction = -start, -bound, -step, "LT" if direction == "GT" else "LE"
    if step <= 0:
        return None
    if direction == "LT":
        return max(0, math.ceil((bound - start) / step))
    if direction == "LE":
        return max(0, (bound - start) // step + 1)
    if direction == "NE" and (bound - start) % step == 0 and bound >= start:
        return (bound - start) // step
    return None


def inferred_trip_count(line: str, caller: list[str], computations: dict[str, list[str]]) -> int | None:
    """The trip count of the `while` instruction `line` of computation `caller`
    (its lines), read as the module docstring says, or None.

    ```python
    inferred_trip_count(while_line, computations["main"], computations)  # e.g. 32
    ```
    """
    condition = re.search(r"\bcondition=%?([\w.\-]+)", line)
    body = re.search(r"\bbody=%?([\w.\-]+)", line)
    if not condition or not body:
        return None
    bound = _bound(computations.get(condition.group(1), []))
    if bound is None:
        return None
    index, direction, limit = bound
    step = _step(computations.get(body.group(1), []), index)
    operand = _operands(line.split(" while(", 1)[1]) if " while(" in line else []
    defs = _defs(caller)
    if step is None or len(operand) != 1 or defs.get(operand[0], ("",))[0] != "tuple":
        return None
    elements = _operands(defs[operand[0]][1])
    start = _constant(defs, elements[index]) if index < len(elements) else None
    return None if start is None else _count(start, direction, limit, step)
