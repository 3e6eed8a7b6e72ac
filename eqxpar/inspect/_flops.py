"""Matrix-multiply FLOPs per device: eqxpar's one counter of a program's FLOPs,
read from compiled HLO text or from a traced jaxpr by the same rules.

`compiled.cost_analysis()["flops"]` counts the body of a `while` loop once,
whatever its trip count, and every branch of a conditional: for a step that runs
its work in loops (micro-batch accumulation, a pipeline's ticks, a ring) it says
little. Here each `dot` is counted at `2 x (result elements) x (contracted
elements)` FLOPs, weighted by how many times its computation runs: a `while`
body by the loop's `known_trip_count` (nested loops multiply), fusions and calls
as often as their caller. A conditional (`lax.cond` / `lax.switch`) counts its
costliest branch: each device runs one branch per execution, and where devices
take different branches in lockstep (a pipeline tick), the tick lasts as long as
its costliest one. Element-wise work is not counted: in a transformer step the
matmuls are nearly all the FLOPs, and they are what a pipeline's recomputation
or bubble adds to.

A jaxpr (`jax.make_jaxpr(f)(...)`) is read by the same rules before anything is
compiled: a `scan` weighted by its `length`, a `cond`/`switch` at its costliest
branch, every other sub-jaxpr (`pjit`, `remat`, custom derivatives, a `while` of
unknown length) once. The advisor counts its candidates' matmuls this way, without
compiling them. (`eqxpar.models.flops_per_token` is a different figure: the FLOPs a
model needs by its formula, the numerator of MFU, whatever a plan runs.)
"""

import math
import re
from typing import Any

from jax.extend import core as jcore

from ._hlo import _BRANCHES, _CALLS, _CONDITIONAL, _SHAPE, _TRIP, _hlo_text, _parse

_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*?)\s+([\w\-]+)\((.*)$")
_PARAMETER = re.compile(r"%?([\w.\-]+):\s*([a-z]+\d*[a-z0-9]*\[[\d,]*\])")
_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")


def _dims(type_text: str) -> list[int]:
    m = _SHAPE.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _product_flops(result_shape: Any, lhs_shape: Any, contracting: Any) -> int:
    # A multiply and an add per term: 2 x result elements x contracted elements.
    return 2 * math.prod(result_shape) * math.prod(lhs_shape[int(i)] for i in contracting)


def _dot_flops(result_type: str, operands: str, types: dict[str, str], line: str) -> int:
    lhs = operands.split(",")[0].strip().lstrip("%").split(")")[0]
    contracting = _CONTRACTING.search(line)
    lhs_dims = _dims(types.get(lhs, ""))
    if contracting is None or not lhs_dims:
        raise ValueError(f"matmul_flops: cannot read the operands of {line.strip()[:200]!r}")
    return _product_flops(_dims(result_type), lhs_dims, [i for i in contracting.group(1).split(",") if i])


def _flops(computations: dict[str, list[str]], headers: dict[str, str], name: str, depth: int = 0) -> int:
    if depth > 64:
        raise ValueError("HLO call graph too deep (recursive computations?)")
    lines = computations.get(name, ())
    # Operand types: parameters from the computation's header, the rest from
    # the instructions that define them.
    types = dict(_PARAMETER.findall(headers.get(name, "")))
    for line in lines:
        m = _NAMED.match(line)
        if m:
            types[m.group(1)] = m.group(2)
    total = 0
    for line in lines:
        m = _NAMED.match(line)
        if not m:
            continue
        result_type, opcode, operands = m.group(2), m.group(3), m.group(4)
        if opcode == "dot":
            total += _dot_flops(result_type, operands, types, line)
            continue
        if opcode == "while":
            trip = _TRIP.search(line)
            body = re.search(r"\bbody=%?([\w.\-]+)", line)
            if body:
                total += (int(trip.group(1)) if trip else 1) * _flops(
                    computations, headers, body.group(1), depth + 1
                )
            continue
        branches = [c.strip().lstrip("%") for group in _BRANCHES.findall(line) for c in group.split(",")]
        branches += _CONDITIONAL.findall(line)
        if branches:
            total += max(_flops(computations, headers, b, depth + 1) for b in branches)
            continue
        if opcode in ("fusion", "call", "async-start"):
            for callee in _CALLS.findall(line):
                total += _flops(computations, headers, callee, depth + 1)
    return total


def _headers(text: str) -> dict[str, str]:
    """Each computation's header line (its parameters and their types)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\((.*)\)\s*->.*\{\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _jaxpr_flops(jaxpr: Any) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            total += _product_flops(eqn.outvars[0].aval.shape, eqn.invars[0].aval.shape, contracting)
        elif name in ("ragged_dot", "ragged_dot_general"):
            # Counted as XLA:CPU runs it: every row through one group's matrix.
            lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
            total += _product_flops((*lhs.shape[:-1], rhs.shape[-1]), lhs.shape, (lhs.ndim - 1,))
        repeat = eqn.params.get("length", 1) if name == "scan" else 1
        for value in eqn.params.values():
            inner = value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value
            if isinstance(inner, jcore.Jaxpr):
                total += repeat * _jaxpr_flops(inner)
            elif isinstance(value, tuple) and any(isinstance(b, jcore.ClosedJaxpr) for b in value):
                total += max(_jaxpr_flops(b.jaxpr) for b in value if isinstance(b, jcore.ClosedJaxpr))
    return total


def matmul_flops(compiled_or_text: Any) -> int:
    """The matrix-multiply FLOPs one device runs in a compiled computation (or all
    of a traced jaxpr), loops weighted by their trip counts, conditionals at their
    costliest branch (see the module docstring).

    **Arguments:**

    - `compiled_or_text`: what `collective_stats` accepts: a compiled computation,
      a lowered one, an eqxpar step's `step.compile(state, batch)`, or the HLO text;
      or a jaxpr (`jax.make_jaxpr(f)(*args)`, closed or not), counted before
      compiling.

    **Returns:** the FLOPs, an `int` (`2 m n k` per `m x k` by `k x n` product).

    ```python
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    matmul_flops(jax.jit(jnp.matmul).lower(x, w).compile())  # 2 * 16 * 8 * 32 = 8192
    ```
    """
    if isinstance(compiled_or_text, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        jaxpr = compiled_or_text
        return _jaxpr_flops(jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr)
    text = _hlo_text(compiled_or_text)
    computations, entry = _parse(text)
    return _flops(computations, _headers(text), entry)
