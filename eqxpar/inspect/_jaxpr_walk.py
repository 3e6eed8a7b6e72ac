"""The tensor-parallel activation sums a function needs, read from its jaxpr
on shape outlines (no plan, one device): `tensor_sums`, the walk behind it
(`TensorSumWalk`) and the tracing on outlines it runs on (`compute_outline`,
`with_key`, `trace_jaxpr`, `tensor_split_dims`). Shared with `eqxpar._advise`
(which walks the same jaxprs for what `minimum_comm` leaves out): internal
names, not public API.
"""

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .._errors import EqxparError, PlanError
from .._jax_compat import scan_body
from .._rules import mesh_axis_names
from .._sizes import array_bytes
from .._specs import is_array_like
from .._text import short
from ._plan_facts import PlanFacts


@dataclasses.dataclass(frozen=True)
class TensorSum:
    """`count` sums over the tensor axis of an activation of `nbytes` (global shape)."""

    where: str  # "forward" (a row-parallel output) or "backward" (a column-parallel input)
    count: int
    nbytes: int
    # Inside a scan (a stack's layers), whose forward a remat policy runs again in
    # the backward pass, and a forward sum with it (see `sum_items`); `last`: the
    # scan body's last forward sum, whose output is the layer's (a layer's
    # backward does not read its own output, so that sum is not recomputed for it).
    scanned: bool = False
    last: bool = False


def aval_bytes(aval: Any, moved: Any) -> int:
    dtype = moved if moved is not None and jnp.issubdtype(aval.dtype, jnp.floating) else aval.dtype
    return array_bytes(aval.shape, dtype)


def _reshape_dims(old: tuple[int, ...], new: tuple[int, ...], dims: frozenset[int]) -> frozenset[int]:
    # The dimension of the reshaped array that holds each split dimension: the one
    # whose run of outer indices contains the split dimension's start.
    out = set()
    for d in dims:
        outer, acc = math.prod(old[:d]), 1
        for j, size in enumerate(new):
            if acc <= outer < acc * size:
                out.add(j)
                break
            acc *= size
    return frozenset(out)


#: Primitives whose output keeps its input's dimensions (and so its split).
_SAME_DIMS = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
        "slice",
        "dynamic_slice",
        "sharding_constraint",
    }
)


def _follow(eqn: Any, dims: frozenset[int]) -> frozenset[int] | None:
    """The split dimensions of a weight after a layout primitive, or None when
    `eqn` is not one (its output is no longer "the weight")."""
    name, params = eqn.primitive.name, eqn.params
    if name in _SAME_DIMS:
        return dims
    if name == "transpose":
        return frozenset(i for i, d in enumerate(params["permutation"]) if d in dims)
    if name == "broadcast_in_dim":
        return frozenset(params["broadcast_dimensions"][d] for d in dims)
    if name == "squeeze":
        kept = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in set(params["dimensions"])]
        return frozenset(kept.index(d) for d in dims if d in kept)
    if name == "reshape":
        return _reshape_dims(tuple(eqn.invars[0].aval.shape), tuple(params["new_sizes"]), dims)
    if name == "concatenate" and params["dimension"] not in dims:
        # Weights joined along a whole dimension (`column_matmul`'s Q, K and V in
        # automatic mode) keep their split.
        return dims
    return None


def _inner(eqn: Any) -> Any:
    """The jaxpr a call-like primitive (jit, checkpoint, custom_jvp/vjp) runs on its
    operands one to one, or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            sub = sub.jaxpr
        if isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(eqn.invars):
            return sub
    return None


@dataclasses.dataclass
class TensorSumWalk:
    """State of one pass over a loss function's jaxpr (see `tensor_sums`)."""

    moved: Any
    sums: list[TensorSum] = dataclasses.field(default_factory=list)
    # Column-parallel inputs already counted (their cotangents are summed once
    # however many weights multiply them: Q, K and V share one).
    seen: set = dataclasses.field(default_factory=set)
    # Scans entered (a sum found at depth > 0 is `scanned`).
    depth: int = 0

    def dot(self, eqn: Any, ins: list, alias: dict, count: int) -> None:
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        if (lhs is None) == (rhs is None) or not (lhs or rhs):
            return
        dims, contract, act = (rhs, rc, eqn.invars[0]) if rhs is not None else (lhs, lc, eqn.invars[1])
        if dims & set(contract):
            # Row-parallel: each device holds a partial product, summed forward.
            self.sums.append(
                TensorSum("forward", count, aval_bytes(eqn.outvars[0].aval, self.moved), self.depth > 0)
            )
            return
        # Column-parallel: the input's cotangent is a partial sum, summed backward.
        key = alias.get(act, act)
        if key not in self.seen:
            self.seen.add(key)
            self.sums.append(TensorSum("backward", count, aval_bytes(act.aval, self.moved), self.depth > 0))

    def gather(self, eqn: Any, ins: list, count: int) -> None:
        # A lookup in rows split over the tensor axis (a vocabulary-parallel
        # embedding): each device finds its own rows, summed forward.
        dims = ins[0]
        if dims and dims & set(eqn.params["dimension_numbers"].start_index_map):
            self.sums.append(
                TensorSum("forward", count, aval_bytes(eqn.outvars[0].aval, self.moved), self.depth > 0)
            )

    def scan(self, eqn: Any, ins: list, alias: dict, count: int) -> None:
        params = eqn.params
        body, _, consts, carry = scan_body(eqn)
        env, inner_alias = {}, {}
        for i, (inner, outer, dims) in enumerate(zip(body.invars, eqn.invars, ins, strict=True)):
            if i < consts and isinstance(outer, jcore.Var):
                inner_alias[inner] = alias.get(outer, outer)
            if dims is not None:
                # Scanned-over operands lose their leading (layer) dimension.
                env[inner] = dims if i < consts + carry else frozenset(d - 1 for d in dims if d > 0)
        self.depth += 1
        before = len(self.sums)
        try:
            self.run(body, env, inner_alias, count * params["length"])
        finally:
            self.depth -= 1
        forward = [i for i in range(before, len(self.sums)) if self.sums[i].where == "forward"]
        if forward:
            self.sums[forward[-1]] = dataclasses.replace(self.sums[forward[-1]], last=True)

    def run(self, jaxpr: Any, env: dict, alias: dict, count: int) -> dict:
        """Walk `jaxpr`, `env` mapping the variables that hold a tensor-split weight to
        its split dimensions; `count` times per step. Returns `env` extended."""
        for eqn in jaxpr.eqns:
            ins = [env.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
            if all(d is None for d in ins):
                continue
            name, sub = eqn.primitive.name, _inner(eqn)
            if name == "dot_general":
                self.dot(eqn, ins, alias, count)
            elif name == "gather":
                self.gather(eqn, ins, count)
            elif name == "scan":
                self.scan(eqn, ins, alias, count)
            elif sub is not None:
                inner_env = {v: d for v, d in zip(sub.invars, ins, strict=True) if d is not None}
                pairs = zip(sub.invars, eqn.invars, strict=True)
                inner_alias = {v: alias.get(o, o) for v, o in pairs if isinstance(o, jcore.Var)}
                found = self.run(sub, inner_env, inner_alias, count)
                for inner, outer in zip(sub.outvars, eqn.outvars, strict=True):
                    if isinstance(inner, jcore.Var) and inner in found:
                        env[outer] = found[inner]
            elif ins[0] is not None and len(eqn.outvars) == 1:
                dims = _follow(eqn, ins[0])
                if dims is not None:
                    env[eqn.outvars[0]] = dims
        return env


def compute_outline(compute: Any, tree: Any) -> Any:
    """`tree` with every array leaf a `ShapeDtypeStruct`, floating ones in the
    plan's compute dtype `compute` (`ParallelDims.compute_dtype`; None keeps
    theirs): what the step's loss sees."""

    def outline(x: Any) -> Any:
        if not is_array_like(x):
            return x
        dtype = x.dtype
        if compute is not None and jnp.issubdtype(dtype, jnp.floating):
            dtype = compute
        return jax.ShapeDtypeStruct(tuple(x.shape), dtype)

    return jax.tree.map(outline, tree)


def trace_jaxpr(fn: Callable, args: tuple, what: str) -> tuple[Any, Any, list[Any]]:
    """`(closed jaxpr, output outline, dynamic leaves)` of `fn(*args)` traced on
    outlines, on one device (no plan): the computation every layout divides up."""
    leaves, treedef = jax.tree.flatten(args)
    where = [i for i, x in enumerate(leaves) if is_array_like(x)]

    def flat(*dynamic: Any) -> Any:
        full = list(leaves)
        for i, x in zip(where, dynamic, strict=True):
            full[i] = x
        return fn(*jax.tree.unflatten(treedef, full))

    try:
        closed, out = jax.make_jaxpr(flat, return_shape=True)(*[leaves[i] for i in where])
    except EqxparError:
        raise
    except Exception as e:
        raise PlanError(
            f"minimum_comm: tracing {what} on the model and batch outlines failed ({type(e).__name__}: "
            f"{short(str(e))}). Pass loss= the function the step differentiates and batch= a global "
            "batch it accepts."
        ) from e
    return closed, out, [leaves[i] for i in where]


def tensor_sums(
    fn: Callable, args: tuple, split: dict[int, frozenset[int]], what: str, moved: Any
) -> list[TensorSum]:
    """The activation sums over the tensor axis that `fn(*args)` needs, read from
    its jaxpr on one device; `split` maps the index of a model leaf (among
    `args[0]`'s array leaves, which come first) to its tensor-split dimensions.

    A weight split on a dimension its matmul contracts (row-parallel) leaves each
    device a partial product: one forward sum of the output. Split on an output
    dimension (column-parallel), the input's cotangent is partial: one backward sum
    of the input, once per input however many weights multiply it. A lookup in
    rows split over the axis (vocabulary-parallel embedding) sums its output
    forward. Each counts once per execution (scans multiply).
    """
    closed, _, _ = trace_jaxpr(fn, args, what)
    env = {closed.jaxpr.invars[i]: dims for i, dims in split.items() if dims}
    walk = TensorSumWalk(moved=moved)
    walk.run(closed.jaxpr, env, {}, 1)
    return walk.sums


def tensor_split_dims(facts: PlanFacts, params: Any) -> dict[int, frozenset[int]]:
    """Array-leaf index -> the dimensions split over the tensor axis (leaves with any)."""
    tensor = facts.dims.tensor_axis
    if facts.mesh.shape.get(tensor, 1) == 1:
        return {}
    specs = jax.tree.structure(params).flatten_up_to(facts.specs(params))
    out, index = {}, 0
    for leaf, spec in zip(jax.tree.leaves(params), specs, strict=True):
        if not is_array_like(leaf):
            continue
        dims = frozenset(d for d, entry in enumerate(spec) if tensor in mesh_axis_names(entry))
        if dims:
            out[index] = dims
        index += 1
    return out


def with_key(loss: Callable) -> Callable:
    # A loss taking `key=` gets one, as make_step gives it (its value moves nothing).
    try:
        takes_key = "key" in inspect.signature(loss).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins)
        takes_key = False
    if not takes_key:
        return loss
    return lambda model, batch: loss(model, batch, key=jax.random.key(0))
