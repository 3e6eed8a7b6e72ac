"""Collective traffic read from compiled HLO text.

Counts each collective's *result* bytes (all-reduce: the full tensor; all-gather:
the gathered tensor; reduce-scatter: the shard; collective-permute: the moved
tensor; all-to-all: the tensor), per device. A collective inside a `while` body is
weighted by the loop's trip count (XLA records it as `known_trip_count`; where
it does not, as in TPU executables, `_trips` reads it from the loop's condition,
body and initial value, and a loop it cannot read counts once), nested loops
multiply, and computations called from several places count once per call.
A conditional (`lax.cond` / `lax.switch`) counts only its branch that moves the
most wire bytes: each device runs one branch per execution, so summing them would
count, e.g., every action of a pipeline tick at once. That is an upper bound where
devices take cheaper branches. Except where the program says which device runs
which branch: eqxpar's pipeline engine names each tick's switch
`eqxpar_tick_s{stride}_b{i_0}_{i_1}...` (the devices at position k along `pipe`,
`partition // stride % pipe`, run branch `i_k` on every iteration). There each
device counts the branch it runs, and the counts are the busiest device's (the
one with the most wire bytes outside collective-permutes); in a tick where one
stage runs a forward with its tensor-parallel sums and another idles, only the
first sums.

Result bytes say how big a collective is, not what it costs: an all-reduce over 2
devices and one over 64 have the same result but move different amounts. So each
collective also gets *wire bytes*, what one device sends under a bandwidth-optimal
ring over its replica group of n devices:

| kind               | wire bytes             |
|--------------------|------------------------|
| all-reduce         | 2 (n-1)/n x result     |
| all-gather         | (n-1)/n x result       |
| reduce-scatter     | (n-1) x result (shard) |
| all-to-all         | (n-1)/n x result       |
| collective-permute | result, per source     |

A ragged all-to-all (`jax.lax.ragged_all_to_all`, eqxpar's MoE dispatch on TPU)
counts as an all-to-all of the smaller of its operand and output buffers: how many
of their rows move depends on the data, but a device sends at most its operand
and receives at most its output, and with balanced routing both are the routed
rows (the larger buffer has room for the worst case).

with 0 when n == 1, rounded down per instruction. A collective-permute's wire
bytes are the busiest device's: each permute charges its result to the devices
its `source_target_pairs` name as sources, and the kind's total is the largest
device's sum (a pipeline's forward permute has no sender on the last stage, its
backward one none on the first). n comes from `replica_groups=`,
written either explicitly (`{{0,1,2,3},{4,5,6,7}}`: the first group's size) or as
an iota (`[G,n]<=[...]`: G groups of n); an empty or missing list means every
device in one group. TPU executables fuse a reduce-scatter (a fusion calling a
computation named `all-reduce-scatter...`: an all-reduce, then this device's
slice): it counts as a reduce-scatter of the fusion's result over the
all-reduce's groups.

A program compiled for several TPU slices (a mesh made with `make_mesh(dcn=...)`)
is the program of one slice: its collectives' replica groups number the devices
of that slice, and what crosses slices over the data-centre network (DCN) is a
`send` to the megascale runtime whose `_xla_megascale_transfer_type` says the
kind (ALL_REDUCE, ALL_GATHER, ...) and `_xla_megascale_target` the groups, as
device ids (`(slice + 1) x 100000 + the device's id in its slice`, explicitly
`{{100000,200000},...}` or as a product `{1,2}x{0:3}`: slices 1 and 2, each
device 0 to 3 with its peers in the others). Each such send is counted as a
collective of its kind over the slices of its first group (n = their number):
an all-reduce sends its whole buffer (wire 2 (n-1)/n x it), an all-gather its
shard (wire (n-1) x it, result n x it), others their buffer ((n-1)/n x it). These
are the bytes that cross slices, also kept apart in `dcn_wire_bytes`.
"""

import dataclasses
import math
import re
from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from .._errors import EqxparError
from .._slices import slice_factors
from .._text import short
from ._compiled import compiled_stage
from ._trips import inferred_trip_count

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
#: Counted as an all-to-all of the routed rows (see the module docstring).
RAGGED_ALL_TO_ALL = "ragged-all-to-all"

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+(\([^)]*\)|\S).*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s+=\s+(.*?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_TRIP = re.compile(r"known_trip_count[^0-9]*(\d+)")
_CALLS = re.compile(r"\b(?:body|to_apply|calls)=%?([\w.\-]+)")
_CONDITIONAL = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"\breplica_groups=\[(\d+),(\d+)\]")
# The whole iota form: [groups,size]<=[dims] with an optional T(permutation).
_GROUPS_IOTA_FULL = re.compile(r"\breplica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_LIST = re.compile(r"\breplica_groups=\{(\{[^}]*\})?")
# Named-mesh form: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}: one group
# per combination of the unnamed axes, spanning the axes named in braces.
# The devices may be given in another order than iota: `, device_ids=([4,2]T(1,0))`.
_GROUPS_MESH = re.compile(
    r"\breplica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)
_MESH_AXIS = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_MODULE_SIZE = re.compile(r"\b(num_partitions|replica_count)=(\d+)")
_PAIRS = re.compile(r"\bsource_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# A pipeline tick's switch, as the engine names it (eqxpar/pipeline/_engine.py, `Device._tick_scope`).
_TICK = re.compile(r"eqxpar_tick_s(\d+)_b(\d+(?:_\d+)*)")
# What crosses slices: a send to the megascale runtime (see the module docstring).
_DCN_KIND = re.compile(r'_xla_megascale_transfer_type="?([A-Z_]+)')
_DCN_GROUPS = re.compile(r"_xla_megascale_target=\{\{([\d,]+)\}")
_DCN_PRODUCT = re.compile(r'_xla_megascale_target="\{([\d,]+)\}x\{(\d+)(?::\d+)?\}"')
#: The megascale runtime's device ids: slice s's device d is (s + 1) x 100000 + d.
DCN_ID_STRIDE = 100_000
_DCN_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}


@dataclasses.dataclass
class CollectiveStats:
    """Collective counts, result bytes and wire bytes (ring cost, see the module
    docstring) by kind, per device; `in_loops` counts (trip-weighted) the
    collectives of each kind that sit inside a `while` body, e.g. a ring's
    collective-permutes, or an all-reduce that should have been after the loop;
    `dtypes` names the element types each kind moves (its counted results, sorted),
    e.g. to check that a bf16 step's collectives do move bf16."""

    count: Counter
    bytes: Counter
    wire_bytes: Counter = dataclasses.field(default_factory=Counter)
    in_loops: Counter = dataclasses.field(default_factory=Counter)
    dtypes: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: Wire bytes by kind and the mesh axes each collective's group spans, e.g.
    #: `{"all-gather": {("fsdp",): 3.1e9}, "all-reduce": {("data", "fsdp"): ...}}`
    #: (empty unless `collective_stats` was given the mesh). A collective-permute
    #: counts its result once per instruction here, whoever sends it.
    by_axes: dict[str, dict[tuple[str, ...], int]] = dataclasses.field(default_factory=dict)
    #: Of `wire_bytes`, what crosses slices over the data-centre network, by kind
    #: (empty for a program of one slice; see the module docstring).
    dcn_wire_bytes: Counter = dataclasses.field(default_factory=Counter)
    #: Of `by_axes`, what crosses slices (with a mesh).
    dcn_by_axes: dict[str, dict[tuple[str, ...], int]] = dataclasses.field(default_factory=dict)

    @property
    def total_dcn_wire_bytes(self) -> int:
        """Wire bytes one device sends to other slices per step."""
        return sum(self.dcn_wire_bytes.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            k: {"count": self.count[k], "bytes": self.bytes[k], "wire_bytes": self.wire_bytes[k]}
            for k in KINDS
            if self.count[k]
        }


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
        raise EqxparError(
            "collective_stats: no ENTRY computation found in the HLO text (starting "
            f"{short(text)}). Pass compiled HLO: compiled.as_text(), not the lowered "
            "StableHLO of lowered.as_text()."
        )
    return computations, entry


def _hlo_text(target: Any) -> str:
    """The compiled HLO text of whatever `collective_stats` accepts."""
    if isinstance(target, str):
        return target
    compiled = compiled_stage(target)
    if compiled is not None:
        return compiled.as_text()
    as_text = getattr(target, "as_text", None)
    if callable(as_text):
        return as_text()
    raise EqxparError(
        f"collective_stats({type(target).__name__} {short(target)}): expected a compiled "
        "computation (jax.jit(f).lower(x).compile() or eqx.filter_jit(f).lower(x).compile()), "
        "its Lowered, or HLO text. For an eqxpar step pass step.compile(state, batch)."
    )


def collective_stats(
    compiled_or_text: Any, num_devices: int | None = None, *, mesh: Any = None
) -> CollectiveStats:
    """Collective counts, result bytes and wire bytes of a compiled computation,
    per device.

    **Arguments:**

    - `compiled_or_text`: a compiled computation (`jax.jit(f).lower(x).compile()`,
      or `eqx.filter_jit(f).lower(x).compile()`), a lowered one (compiled here:
      XLA places the collectives when it partitions the program), anything else
      whose `.as_text()` is compiled HLO, or the HLO text itself.
    - `num_devices`: the group size of a collective whose `replica_groups` is
      empty (all devices). Only needed then, and only when the `HloModule` line
      lacks `num_partitions=`/`replica_count=` (XLA omits them when 1).
    - `mesh`: the `jax.sharding.Mesh` the computation was compiled for (keyword
      only, optional): with it, `by_axes` splits each kind's wire bytes by the
      mesh axes its groups span (device ids read as positions in the mesh's
      device order, as jit assigns them; over several slices, positions in one
      slice's part of the mesh, and the megascale runtime's ids of what crosses
      slices as the mesh's devices).

    **Returns:** a `CollectiveStats` (`.count`, `.bytes`, `.wire_bytes`, `.in_loops`
    and `.dtypes` by kind; `.total_bytes`, `.total_wire_bytes`; `.dcn_wire_bytes`,
    what crosses slices).

    **Raises:** `EqxparError` (a `ValueError`) for an argument it cannot read, text
    with no `ENTRY` computation, or a collective that spans all devices when their
    number is neither given nor in the text.

    ```python
    stats = collective_stats(jax.jit(f).lower(x).compile())
    stats.wire_bytes["all-reduce"]  # e.g. 3072: a 2048-byte psum over 4 devices
    stats.dtypes["all-reduce"]  # e.g. ("f32",): what the psum moves
    ```
    """
    text = _hlo_text(compiled_or_text)
    computations, entry = _parse(text)
    if num_devices is None:
        num_devices = _module_devices(text)
    mesh_axes = dcn_ids = None
    if mesh is not None:
        factors = slice_factors(mesh.devices)
        # A program of one slice numbers that slice's devices: its part of the mesh.
        mesh_axes = tuple(
            (str(a), int(mesh.shape[a]) // f) for a, f in zip(mesh.axis_names, factors, strict=True)
        )
        if math.prod(factors) > 1:
            dcn_ids = {int(d.id): tuple(map(int, at)) for at, d in np.ndenumerate(mesh.devices)}
    if num_devices is None and mesh_axes is not None:
        num_devices = math.prod(size for _, size in mesh_axes)
    acc = walk_tally(_Walk(computations, num_devices, mesh_axes, dcn_ids), entry)
    dtypes: dict[str, set[str]] = {}
    for kind, dtype in acc.dtypes:
        dtypes.setdefault(kind, set()).add(dtype)
    return CollectiveStats(
        count=acc.count,
        bytes=acc.bytes,
        wire_bytes=acc.wire,
        in_loops=acc.in_loops,
        dtypes={k: tuple(sorted(dtypes[k])) for k in KINDS if k in dtypes},
        by_axes={
            k: {axes: n for (kind, axes), n in sorted(acc.axes.items()) if kind == k}
            for k in KINDS
            if any(kind == k for kind, _ in acc.axes)
        },
        dcn_wire_bytes=Counter(
            {k: n for k in KINDS if (n := sum(v for (kind, _), v in acc.dcn.items() if kind == k))}
        ),
        dcn_by_axes={
            k: {axes: n for (kind, axes), n in sorted(acc.dcn.items()) if kind == k and axes is not None}
            for k in KINDS
            if any(kind == k and axes is not None for kind, axes in acc.dcn)
        },
    )


def walk_tally(walk: "_Walk", entry: str) -> "_Tally":
    """What `walk` counts from the entry computation on, the busiest device's
    collective-permutes (and per-device conditionals) settled."""
    acc = _tally()
    walk.visit(entry, 1, 0, False, acc)
    _add_busiest_device(acc)
    if acc.sends:  # the busiest device's permutes
        acc.wire["collective-permute"] += max(acc.sends.values())
    return acc


def _module_devices(text: str) -> int | None:
    """The device count the `HloModule` line states (`num_partitions` x `replica_count`),
    or None when it states neither."""
    header = re.search(r"^HloModule\b.*$", text, re.MULTILINE)
    sizes = dict(_MODULE_SIZE.findall(header.group(0))) if header else {}
    if not sizes:
        return None
    return int(sizes.get("num_partitions", 1)) * int(sizes.get("replica_count", 1))


class _Tally(NamedTuple):
    """Per-kind collective counts, result bytes, wire bytes, counts inside loops, and
    counts by (kind, element type) of the results."""

    count: Counter
    bytes: Counter
    wire: Counter
    in_loops: Counter
    dtypes: Counter
    # Wire bytes by (kind, the mesh axes a collective's group spans), with a mesh.
    axes: Counter
    # Wire bytes by (kind, mesh axes or None without a mesh) that cross slices
    # (the megascale runtime's sends).
    dcn: Counter
    # Collective-permute bytes each device sends, by device id.
    sends: Counter
    # What each device adds in the conditionals whose branch per device is known.
    devices: dict


def _tally() -> _Tally:
    return _Tally(Counter(), Counter(), Counter(), Counter(), Counter(), Counter(), Counter(), Counter(), {})


def _merge(into: _Tally, part: _Tally, device: int | None = None) -> None:
    """Add `part` to `into`; with `device`, `part`'s own per-device counts of that
    device too (the branch that device runs), else all of them as they are."""
    for total, counts in zip(into[:8], part[:8], strict=True):
        total.update(counts)
    for d, extra in part.devices.items():
        if device is None:
            _merge(into.devices.setdefault(d, _tally()), extra)
        elif d == device:
            _merge(into, extra)


def _add_busiest_device(acc: _Tally) -> None:
    """Add to `acc` the per-device counts of the device that moves the most wire
    bytes in them (collective-permutes aside: those are counted per sender, and
    each device's own sends are added to its count)."""
    if not acc.devices:
        return
    for d, extra in acc.devices.items():
        acc.sends[d] += extra.sends[d]
    busiest = max(acc.devices.values(), key=lambda t: (sum(t.wire.values()), sum(t.bytes.values())))
    for total, counts in zip(acc[:7], busiest[:7], strict=True):
        total.update(counts)
    acc.devices.clear()


def _sources(line: str) -> set[int] | None:
    """The sending devices of a collective-permute (None: no pairs written)."""
    m = _PAIRS.search(line)
    if not m:
        return None
    return {int(a) for a, _ in re.findall(r"\{(\d+),(\d+)\}", m.group(1))}


@dataclasses.dataclass(frozen=True)
class _Walk:
    """A walk of the HLO call graph from the entry computation, weighting each
    collective by how many times its computation runs."""

    computations: dict[str, list[str]]
    num_devices: int | None
    # The mesh's (axis, size) in device order, to name the axes a group spans
    # (over several slices, one slice's part of the mesh).
    mesh_axes: tuple[tuple[str, int], ...] | None = None
    # Over several slices: each device's id -> its position in the whole mesh.
    dcn_ids: dict[int, tuple[int, ...]] | None = None

    def all_devices(self) -> int:
        # Raised lazily: text whose collectives all name their groups needs no count.
        if self.num_devices is None:
            raise EqxparError(
                "collective_stats: a collective has empty replica_groups (all devices) but "
                "the HLO text has no num_partitions=/replica_count= on its HloModule line; "
                "pass collective_stats(..., num_devices=N)."
            )
        return self.num_devices

    def counts(self, computation: str, line: str, opcode: str) -> bool:
        """Whether this collective instruction of `computation` is counted: all are
        (a subclass counts some, e.g. `_overlap`'s the overlapped ones)."""
        return True

    def descends(self, line: str, opcode: str) -> bool:
        """Whether the walk goes into the computations this instruction calls."""
        return True

    def visit(self, name: str, weight: int, depth: int, looped: bool, acc: _Tally) -> None:
        if depth > 64:
            raise ValueError("HLO call graph too deep (recursive computations?)")
        for line in self.computations.get(name, ()):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result_type, opcode = m.group(2), m.group(3)
            if opcode == "send" and (dcn := _DCN_KIND.search(line)) and self.counts(name, line, opcode):
                self._add_dcn(
                    acc, line, _DCN_KINDS.get(dcn.group(1), "all-to-all"), result_type, weight, looped
                )
                continue
            base = opcode.removesuffix("-start")
            if base == RAGGED_ALL_TO_ALL:
                if not opcode.endswith("-done") and self.counts(name, line, opcode):
                    moved = _ragged_moved(line, opcode, self.computations[name])
                    self._add(acc, line, "all-to-all", "all-to-all", moved, weight, looped)
                continue
            if base in KINDS and not opcode.endswith("-done") and self.counts(name, line, opcode):
                self._add(acc, line, base, opcode, result_type, weight, looped)
            if not self.descends(line, opcode):
                continue
            inner = weight
            if opcode == "while":
                trip = _TRIP.search(line)
                count = (
                    int(trip.group(1))
                    if trip
                    else inferred_trip_count(line, self.computations[name], self.computations)
                )
                inner = weight * (1 if count is None else count)
            if opcode == "fusion":
                inner_all_reduce = self._fused_reduce_scatter(line)
                if inner_all_reduce is not None and self.counts(name, line, "reduce-scatter"):
                    # The fusion's result is the shard; the groups are the all-reduce's.
                    inner, kind = inner_all_reduce, "reduce-scatter"
                    self._add(acc, inner, kind, kind, result_type, weight, looped)
                # Fusions hold no other collectives.
                continue
            if base in KINDS:
                # Reducers of collectives are scalars.
                continue
            for callee in _CALLS.findall(line):
                self.visit(callee, inner, depth + 1, looped or opcode == "while", acc)
            self._visit_branches(line, inner, depth, looped, acc)

    def _fused_reduce_scatter(self, line: str) -> str | None:
        """The all-reduce instruction of a fused reduce-scatter that `line` (a
        fusion) calls, or None. TPU executables write a reduce-scatter as a
        fusion of an all-reduce and this device's slice, in a computation named
        `all-reduce-scatter...`; it moves a reduce-scatter's bytes."""
        for callee in _CALLS.findall(line):
            if not callee.startswith("all-reduce-scatter"):
                continue
            for inner in self.computations.get(callee, ()):
                m = _INSTRUCTION.match(inner)
                if m and m.group(3) in ("all-reduce", "all-reduce-start"):
                    return inner
        return None

    def _add(
        self, acc: _Tally, line: str, base: str, opcode: str, result_type: str, weight: int, looped: bool
    ) -> None:
        """Count one collective instruction, run `weight` times."""
        acc.count[base] += weight
        if looped:
            acc.in_loops[base] += weight
        # An async start's result is a tuple (operands, results[, scratch]), but
        # all-reduce-start's is all-reduce's: the moved data is the result element.
        tupled = opcode.endswith("-start") and base != "all-reduce"
        moved = _async_result(result_type) if tupled else result_type
        size = shape_bytes(moved)
        acc.bytes[base] += weight * size
        for dtype, _ in _SHAPE.findall(moved):
            if dtype in _DTYPE_BYTES:
                acc.dtypes[base, dtype] += weight
        if base == "collective-permute":
            sources = _sources(line)
            if sources is None:
                acc.wire[base] += weight * size
            for device in sources or ():
                acc.sends[device] += weight * size
            wire = weight * size
        else:
            wire = weight * _ring_bytes(base, size, _group_size(line) or self.all_devices())
            acc.wire[base] += wire
        if self.mesh_axes is not None:
            acc.axes[base, self._group_axes(line, base)] += wire

    def _add_dcn(
        self, acc: _Tally, line: str, base: str, result_type: str, weight: int, looped: bool
    ) -> None:
        """Count one send across slices (see the module docstring), run `weight` times."""
        payload = shape_bytes(_tuple_elements(result_type)[0])  # (operand, u32[], token[])
        members = _dcn_first_group(line)
        n = len({m // DCN_ID_STRIDE for m in members}) if members else 2
        if base == "all-gather":
            size, wire = n * payload, (n - 1) * payload
        else:
            size, wire = payload, _ring_bytes(base, payload, n)
        acc.count[base] += weight
        if looped:
            acc.in_loops[base] += weight
        acc.bytes[base] += weight * size
        for dtype, _ in _SHAPE.findall(result_type):
            if dtype in _DTYPE_BYTES and dtype not in ("u32",):
                acc.dtypes[base, dtype] += weight
        acc.wire[base] += weight * wire
        axes = None if self.mesh_axes is None else self._dcn_axes(members)
        acc.dcn[base, axes] += weight * wire
        if axes is not None:
            acc.axes[base, axes] += weight * wire

    def _dcn_axes(self, members: list[int] | None) -> tuple[str, ...]:
        """The mesh axes along which the devices of a send's first group across
        slices differ ("?" where the ids are not the mesh's)."""
        assert self.mesh_axes is not None
        if not members or self.dcn_ids is None or any(m not in self.dcn_ids for m in members):
            return ("?",)
        coords = np.array([self.dcn_ids[m] for m in members]).T
        return tuple(name for (name, _), row in zip(self.mesh_axes, coords, strict=True) if len(set(row)) > 1)

    def _group_axes(self, line: str, base: str) -> tuple[str, ...]:
        """The mesh axes along which the devices of the collective's (first)
        group differ: the axes it communicates over."""
        assert self.mesh_axes is not None
        members = _first_group(line, base)
        if members is None:
            members = list(range(self.all_devices()))
        sizes = [size for _, size in self.mesh_axes]
        if max(members, default=0) >= math.prod(sizes):
            return ("?",)
        coords = np.array(np.unravel_index(members, sizes))
        return tuple(name for (name, _), row in zip(self.mesh_axes, coords, strict=True) if len(set(row)) > 1)

    def _visit_branches(self, line: str, weight: int, depth: int, looped: bool, acc: _Tally) -> None:
        branches = [c.strip().lstrip("%") for group in _BRANCHES.findall(line) for c in group.split(",")]
        branches += _CONDITIONAL.findall(line)
        if not branches:
            return
        # A device runs one branch per execution of a conditional: count the
        # branch that moves the most (e.g. a pipeline tick's costliest
        # action), not their sum.
        taken = []
        for callee in branches:
            sub = _tally()
            self.visit(callee, weight, depth + 1, looped, sub)
            taken.append(sub)
        chosen = self._branch_per_device(line, len(taken))
        if chosen is not None:
            for device, branch in enumerate(chosen):
                _merge(acc.devices.setdefault(device, _tally()), taken[branch], device)
            return
        heaviest = max(
            taken,
            key=lambda sub: (
                sum(sub.wire.values()) + max(sub.sends.values(), default=0),
                sum(sub.bytes.values()),
            ),
        )
        _merge(acc, heaviest)

    def _branch_per_device(self, line: str, branches: int) -> list[int] | None:
        """The branch each device runs, by device id, where the conditional's name
        says (a pipeline tick); else None."""
        tick = _TICK.search(line)
        if tick is None or self.num_devices is None:
            return None
        stride, by_position = int(tick.group(1)), [int(b) for b in tick.group(2).split("_")]
        if max(by_position) >= branches or stride < 1:
            return None  # not the switch the name was given to: count the heaviest
        return [by_position[(d // stride) % len(by_position)] for d in range(self.num_devices)]


def _first_group(line: str, base: str) -> list[int] | None:
    """The device ids of a collective's first replica group (a permute's first
    source-target pair); None for all devices."""
    if base == "collective-permute":
        m = _PAIRS.search(line)
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(1)) if m else []
        return [int(d) for d in pairs[0]] if pairs else None
    m = _GROUPS_MESH.search(line)
    if m:
        axes = [(name, int(n)) for name, n in _MESH_AXIS.findall(m.group(1))]
        sizes = [n for _, n in axes]
        order = np.arange(math.prod(sizes))
        if m.group(2):
            order = order.reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                order = order.transpose([int(d) for d in m.group(3).split(",")])
        named = {a.strip().strip("'") for a in m.group(4).split(",") if a.strip()}
        index = tuple(slice(None) if name in named else 0 for name, _ in axes)
        return order.reshape(sizes)[index].reshape(-1).tolist()
    m = _GROUPS_IOTA_FULL.search(line)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(groups, size)[0].tolist()
    m = _GROUPS_LIST.search(line)
    if m and m.group(1):
        return [int(d) for d in m.group(1).strip("{}").split(",") if d.strip()] or None
    return None


def _dcn_first_group(line: str) -> list[int] | None:
    """The megascale device ids of a send's first group across slices."""
    m = _DCN_GROUPS.search(line)
    if m:
        return [int(d) for d in m.group(1).split(",") if d]
    m = _DCN_PRODUCT.search(line)
    if m:
        # {1,2}x{0:3}: slices 1 and 2 (the ids' leading digit), each device 0..3 of
        # a slice with the same device of the others: the first group is device 0's.
        return [int(s) * DCN_ID_STRIDE + int(m.group(2)) for s in m.group(1).split(",") if s]
    return None


def _ragged_moved(line: str, opcode: str, lines: list[str]) -> str:
    """The type of what a ragged all-to-all moves: the smaller of its operand
    and output buffers. An async start's result tuple begins with their types;
    a synchronous one writes them beside its operands, or (compiled TPU text)
    names the operands only, whose types are read from the instructions of its
    computation (`lines`) that define them."""
    if opcode.endswith("-start"):
        shapes = _SHAPE.findall(line.split("=", 1)[1])[:2]
    else:
        args = line.split(f"{opcode}(", 1)[1]
        shapes = _SHAPE.findall(args.split(")", 1)[0])[:2]
        if len(shapes) < 2:
            names = re.findall(r"%([\w.\-]+)", args)[:2]
            shapes = [_SHAPE.search(_defined_type(n, lines)).groups() for n in names]
    return min((f"{t}[{d}]" for t, d in shapes), key=shape_bytes)


def _defined_type(name: str, lines: list[str]) -> str:
    """The result type of instruction `%name` among `lines` (one computation)."""
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m and re.match(rf"^\s*(ROOT\s+)?%?{re.escape(name)}\s+=", line):
            return m.group(2)
    raise ValueError(f"collective_stats: no instruction %{name} defines a ragged all-to-all's operand")


def _group_size(line: str) -> int | None:
    # None: empty or missing replica_groups, i.e. all devices in one group.
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = {name: int(n) for name, n in _MESH_AXIS.findall(m.group(1))}
        named = [a.strip().strip("'") for a in m.group(4).split(",") if a.strip()]
        size = 1
        for axis in named:
            size *= sizes.get(axis, 1)
        return size
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(line)
    if m and m.group(1):
        return len([d for d in m.group(1).strip("{}").split(",") if d.strip()]) or None
    return None


def _ring_bytes(kind: str, size: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * (n - 1) * size // n
    if kind == "reduce-scatter":
        return (n - 1) * size
    return (n - 1) * size // n  # all-gather, all-to-all


def _async_result(result_type: str) -> str:
    # "((f32[8,4]{1,0}), f32[16,4]{1,0}, ...)": take the second top-level element.
    parts = _tuple_elements(result_type)
    return parts[1] if len(parts) > 1 else result_type.strip()


def _tuple_elements(result_type: str) -> list[str]:
    """The top-level elements of a tuple type `(a, b, ...)` (the commas of shapes
    and layouts sit deeper)."""
    depth, parts, start = 0, [], 1
    body = result_type.strip()
    for i, ch in enumerate(body):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:-1])
    return parts
