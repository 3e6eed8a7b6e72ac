"""A stage's backward pass split in two, for zero-bubble's input and weight halves.
Shared with the tests and `benchmarks/` (which time and check the halves of a
stage's pull-back, `split_pull_back`): internal names, not public API.

A backward pass computes the input cotangent (what the previous stage waits for)
and the weight cotangents (what nobody waits for). Zero-bubble runs them as two
actions, `I` then `W`, at different ticks. Taken as two pull-backs of the same
`jax.vjp`, `W` would re-run the whole chain of activation cotangents that `I`
already ran: every layer's weight cotangent needs the cotangent of that layer's
output. Split here instead, `I` runs the part of the backward jaxpr the input
cotangent needs (part A) and hands `W` the values computed there that the
weight cotangents need (the stash: for a matmul `y = x @ w`, `dy`); `W` runs the
rest (part B: `x.T @ dy`, and what leads only there). Together they run the
backward pass once.

A scan in the backward pass (a stack of layers, transposed) is split the same
way, body by body: part A runs the scan of the carried activation cotangents
and returns the stash of every iteration as extra outputs; part B runs a second
scan over those, one that carries only what B alone needs (e.g. the sum of a
weight cotangent shared by every layer). Any other primitive, higher-order ones
included, runs whole, in A if the input cotangent needs it.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jax import lax
from jax._src import core

from .._jax_compat import scan_body

Key = Any  # a jaxpr Var, or ("scan", equation index, stash index) for a scan's stash


@dataclasses.dataclass
class _ScanSplit:
    """How one scan equation splits: which carries and outputs part A's scan
    produces and which part B's, and the split of the body."""

    body: "_Split"
    a_carry: list[bool]
    a_ys: list[bool]
    b_carry: list[bool]
    b_ys: list[bool]


@dataclasses.dataclass
class _Split:
    """Which equations of a jaxpr part A runs (`a`) and part B runs (`b`: its own,
    and the B halves of split scans), how each scan among them splits, the
    stash (the values, by key, A hands to B) and which inputs B reads."""

    a: list[int]
    b: list[int]
    scans: dict[int, _ScanSplit]
    stash: list[Key]
    b_reads: list[bool]


def _is_var(v: Any) -> bool:
    return isinstance(v, core.Var) and not isinstance(v, core.DropVar)


def _scan_parts(eqn: core.JaxprEqn) -> tuple[core.Jaxpr, int, int]:
    body, _, nc, ncarry = scan_body(eqn)
    return body, nc, ncarry


def _needs(
    jaxpr: core.Jaxpr, used: Sequence[bool], also: frozenset = frozenset()
) -> tuple[set[int], list[bool], dict[int, tuple]]:
    """Dead-code analysis: `(equations needed for the used outputs and the
    variables `also`, inputs needed, per needed scan equation its (used
    carries, used outputs))`."""
    live = {v for v, u in zip(jaxpr.outvars, used, strict=True) if u and _is_var(v)} | set(also)
    needed: set[int] = set()
    scans: dict[int, tuple] = {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = [_is_var(o) and o in live for o in eqn.outvars]
        if not any(outs) and not eqn.effects:
            continue
        needed.add(i)
        if eqn.primitive.name == "scan":
            carry, ys, inputs = _scan_needs(eqn, outs)
            scans[i] = (carry, ys)
            live |= {v for v, n in zip(eqn.invars, inputs, strict=True) if n and _is_var(v)}
        else:
            live |= {v for v in eqn.invars if _is_var(v)}
    return needed, [v in live for v in jaxpr.invars], scans


def _scan_needs(eqn: core.JaxprEqn, used: Sequence[bool]) -> tuple[list[bool], list[bool], list[bool]]:
    """The carries and outputs a scan computes for its `used` outputs (a used
    carry's input makes its output used, to a fixed point), and its inputs."""
    body, nc, ncarry = _scan_parts(eqn)
    carry, ys = list(used[:ncarry]), list(used[ncarry:])
    while True:
        _, inputs, _ = _needs(body, carry + ys)
        more = [c or n for c, n in zip(carry, inputs[nc : nc + ncarry], strict=True)]
        if more == carry:
            return carry, ys, inputs
        carry = more


def analyse(
    jaxpr: core.Jaxpr,
    want_a: Sequence[bool],
    want_b: Sequence[bool],
    b_inputs: set,
    also: frozenset = frozenset(),
) -> _Split:
    """Split `jaxpr`: part A computes the outputs `want_a` marks (and the
    variables `also`), part B those `want_b` marks, reading only the inputs in
    `b_inputs`, A's stash, and (always) the jaxpr's constants."""
    a_eqns, _, a_scans = _needs(jaxpr, want_a, also)
    live = {v for v, w in zip(jaxpr.outvars, want_b, strict=True) if w and _is_var(v)}
    b_eqns: set[int] = set()
    scans: dict[int, _ScanSplit] = {}
    stash: list[Key] = []

    def to_stash(v: Any) -> None:
        if v not in stash:
            stash.append(v)

    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = [_is_var(o) and o in live for o in eqn.outvars]
        in_a = i in a_eqns
        if in_a:
            produced = list(a_scans[i][0]) + list(a_scans[i][1]) if i in a_scans else [True] * len(outs)
        else:
            produced = [False] * len(outs)
        for o, u, p in zip(eqn.outvars, outs, produced, strict=True):
            if u and p:
                to_stash(o)
        rest = [u and not p for u, p in zip(outs, produced, strict=True)]
        if eqn.primitive.name == "scan" and (in_a or any(rest)):
            # A scan A runs, B runs, or both: each runs its own scan of the body's part.
            n = len(eqn.outvars)
            split, reads = _split_scan(eqn, a_scans.get(i, ([False] * n, [])), rest)
            scans[i] = split
            if any(rest):
                b_eqns.add(i)
                live |= {v for v, r in zip(eqn.invars, reads, strict=True) if r and _is_var(v)}
                for k in range(len(split.body.stash)):
                    to_stash(("scan", i, k))
        elif any(rest):
            b_eqns.add(i)
            live |= {v for v in eqn.invars if _is_var(v)}
    for v in jaxpr.invars:
        if v in live and v not in b_inputs:
            to_stash(v)
    b_reads = [v in live and v in b_inputs for v in jaxpr.invars]
    return _Split(sorted(a_eqns), sorted(b_eqns), scans, stash, b_reads)


def _split_scan(eqn: core.JaxprEqn, a_used: tuple, rest: list[bool]) -> tuple[_ScanSplit, list[bool]]:
    """Split one scan: A's scan produces `a_used`'s carries and outputs, B's
    those of `rest` and every carry B's body reads that A's does not carry.
    Returns the split and which of the equation's inputs B's scan reads."""
    body, nc, ncarry = _scan_parts(eqn)
    a_carry = list(a_used[0][:ncarry])
    a_ys = list(a_used[1]) if a_used[1] else [False] * (len(eqn.outvars) - ncarry)
    b_carry, b_ys = list(rest[:ncarry]), list(rest[ncarry:])
    carry_in = body.invars[nc : nc + ncarry]
    while True:
        free = set(body.invars[:nc]) | set(body.invars[nc + ncarry :])
        free |= {v for v, b in zip(carry_in, b_carry, strict=True) if b}
        split = analyse(body, a_carry + a_ys, b_carry + b_ys, free)
        # A carry B's body reads and A's scan does not carry: B carries it.
        more = [b or (v in split.stash and not a) for v, a, b in zip(carry_in, a_carry, b_carry, strict=True)]
        if more == b_carry:
            break
        b_carry = more
    reads = list(split.b_reads)
    for k in range(ncarry):  # B's carries start from the scan's initial values
        reads[nc + k] = b_carry[k]
    return _ScanSplit(split, a_carry, a_ys, b_carry, b_ys), reads


def _bind(eqn: core.JaxprEqn, values: list) -> list:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


class _Env:
    def __init__(self, jaxpr: core.Jaxpr, consts: Sequence, inputs: Sequence):
        self.values: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        for v, x in zip(jaxpr.invars, inputs, strict=True):
            if x is not None:
                self.values[v] = x

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else self.values[v]

    def inputs(self, eqn: core.JaxprEqn) -> list:
        # None where part A or B has not computed an input its scan does not read.
        return [self.read(v) if not _is_var(v) or v in self.values else None for v in eqn.invars]

    def write(self, vs: Sequence, xs: Sequence) -> None:
        for v, x in zip(vs, xs, strict=True):
            if _is_var(v) and x is not None:
                self.values[v] = x


def run_a(
    jaxpr: core.Jaxpr, consts: Sequence, split: _Split, want_a: Sequence[bool], inputs: Sequence
) -> tuple:
    """Part A: `(the outputs want_a marks, the stash)`."""
    env = _Env(jaxpr, consts, inputs)
    for i in split.a:
        eqn = jaxpr.eqns[i]
        if i in split.scans:
            outs, stash = _run_scan(eqn, split.scans[i], env.inputs(eqn), part="a")
            for k, x in enumerate(stash):
                env.values[("scan", i, k)] = x
        else:
            outs = _bind(eqn, env.inputs(eqn))
        env.write(eqn.outvars, outs)
    outs = [env.read(v) for v, w in zip(jaxpr.outvars, want_a, strict=True) if w]
    return outs, [env.values[k] for k in split.stash]


def run_b(
    jaxpr: core.Jaxpr,
    consts: Sequence,
    split: _Split,
    want_b: Sequence[bool],
    inputs: Sequence,
    stash: Sequence,
) -> list:
    """Part B: the outputs `want_b` marks, from the inputs B reads (None for the
    others) and A's stash."""
    env = _Env(jaxpr, consts, [x if r else None for x, r in zip(inputs, split.b_reads, strict=True)])
    for k, x in zip(split.stash, stash, strict=True):
        env.values[k] = x
    for i in split.b:
        eqn = jaxpr.eqns[i]
        if i in split.scans:
            parts = [env.values[("scan", i, k)] for k in range(len(split.scans[i].body.stash))]
            outs, _ = _run_scan(eqn, split.scans[i], env.inputs(eqn), part="b", stash=parts)
        else:
            outs = _bind(eqn, env.inputs(eqn))
        env.write(eqn.outvars, outs)
    return [env.read(v) for v, w in zip(jaxpr.outvars, want_b, strict=True) if w]


def _run_scan(eqn: core.JaxprEqn, ss: _ScanSplit, values: list, *, part: str, stash: list = ()) -> tuple:
    """Part `part` of a split scan: `(the equation's outputs, None where this
    part does not compute one; for A, the stash of every iteration)`."""
    body_jaxpr, body_consts, nc, ncarry = scan_body(eqn)
    consts, init, xs = values[:nc], values[nc : nc + ncarry], values[nc + ncarry :]
    keep_carry, keep_ys = (ss.a_carry, ss.a_ys) if part == "a" else (ss.b_carry, ss.b_ys)
    carried = [k for k in range(ncarry) if keep_carry[k]]

    def body(carry, x):
        x, parts = x
        full = [None] * ncarry
        for k, c in zip(carried, carry, strict=True):
            full[k] = c
        args = consts + full + list(x)
        if part == "a":
            outs, made = run_a(body_jaxpr, body_consts, ss.body, keep_carry + keep_ys, args)
        else:
            outs, made = run_b(body_jaxpr, body_consts, ss.body, keep_carry + keep_ys, args, parts), []
        return outs[: len(carried)], (outs[len(carried) :], made)

    carry, (ys, made) = lax.scan(
        body,
        [init[k] for k in carried],
        (xs, list(stash)),
        length=eqn.params["length"],
        reverse=eqn.params["reverse"],
        unroll=eqn.params["unroll"],
    )
    outs: list = [None] * len(eqn.outvars)
    for k, c in zip(carried, carry, strict=True):
        outs[k] = c
    for k, y in zip([k for k, w in enumerate(keep_ys) if w], ys, strict=True):
        outs[ncarry + k] = y
    return outs, list(made)


class SplitBackward:
    """A backward function `backward(*inputs) -> outputs` (flat lists of arrays)
    split into `input_half` (its last `input_outputs` outputs, the input
    cotangent, and a stash) and `weight_half` (the others, from the inputs and
    the stash). The split depends only on the function and the inputs' types:
    built twice for the same stage, it is the same, so `I` and `W` each build
    their own.

    With no input cotangent (`input_outputs=0`: the first stage, whose input is
    the batch), the input half runs the chain of activation cotangents all the
    same (the carries of the backward's scans: the stack's layers, transposed),
    so that the two halves stay about as costly as they are on other stages."""

    def __init__(self, backward: Any, inputs: Sequence, *, input_outputs: int):
        closed = jax.make_jaxpr(backward)(*inputs)
        self.jaxpr, self.consts = closed.jaxpr, closed.consts
        n = len(self.jaxpr.outvars)
        self.want_a = [i >= n - input_outputs for i in range(n)]
        self.want_b = [not w for w in self.want_a]
        chain = frozenset(
            o
            for eqn in self.jaxpr.eqns
            if eqn.primitive.name == "scan" and not input_outputs
            for o in eqn.outvars[: _scan_parts(eqn)[2]]
            if _is_var(o)
        )
        self.split = analyse(self.jaxpr, self.want_a, self.want_b, set(self.jaxpr.invars), chain)

    def input_half(self, inputs: Sequence) -> tuple[list, list]:
        """`(the input cotangent's outputs, the stash)`."""
        return run_a(self.jaxpr, self.consts, self.split, self.want_a, list(inputs))

    def weight_half(self, inputs: Sequence, stash: Sequence) -> list:
        """The other outputs (the weight cotangents)."""
        return run_b(self.jaxpr, self.consts, self.split, self.want_b, list(inputs), stash)


def split_pull_back(leaves: list, treedef: Any, seed: jax.Array, first: bool) -> tuple[SplitBackward, list]:
    """A stage's pull-back (its leaves and treedef) split into its input and
    weight halves, and the halves' inputs (the pull-back's arrays and the seed).
    The first stage's has no input cotangent (`SplitBackward`)."""
    where = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]

    def backward(*args):
        filled = list(leaves)
        for i, a in zip(where, args[:-1], strict=True):
            filled[i] = a
        return jax.tree.leaves(jax.tree.unflatten(treedef, filled)(args[-1]))

    inputs = [leaves[i] for i in where] + [seed]
    return SplitBackward(backward, inputs, input_outputs=0 if first else 1), inputs
