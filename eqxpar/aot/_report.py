"""`AotReport`: what compiling a train step ahead of time tells before a chip is rented."""

import dataclasses
from typing import Any

from .._text import fmt_int, fmt_ratio, render
from ..inspect import CollectiveStats, Minimum, OverlapStats

#: What `cost_analysis()` figures are not, printed with them.
COST_CAVEAT = (
    "the backend's cost_analysis(), not a step time: on TPU it counts a loop body once (a scanned "
    "stack's layers once, not per layer), leaves out collective time, and charges a Pallas kernel "
    "(e.g. splash attention) nearly nothing"
)

_GIB = 2**30
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _gib(n: int | float) -> str:
    return f"{n / _GIB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class AotReport:
    """A train step compiled ahead of time: memory per device against the chip's,
    collectives per mesh axis against the plan's minimum, how much of that traffic
    the compiler scheduled asynchronously, and how long compiling took.

    Built by `eqxpar.aot.compile_train_step` (and printed by `python -m
    eqxpar.aot`). Memory figures are `compiled.memory_analysis()`'s, per device:
    `argument` (state and batch), `output`, `alias` (outputs written over donated
    arguments), `temp` (everything the step allocates while it runs);
    `peak_bytes = argument + output - alias + temp`.

    **Fields:** `model` and `topology` (names, as given), `chips`, `mesh` (axis
    sizes), `plan` (a line describing it), `tokens_per_step`; `argument_bytes`,
    `output_bytes`, `alias_bytes`, `temp_bytes`, `code_bytes`;
    `memory_per_chip` (bytes of memory each device has, None where unknown);
    `collectives` (`eqxpar.inspect.CollectiveStats`, with `by_axes`);
    `minimum` (`eqxpar.inspect.Minimum` or None) and `minimum_note`;
    `overlap` (`eqxpar.inspect.OverlapStats`); `lower_seconds`,
    `compile_seconds`; `peak_rss_bytes` (this process's, after compiling);
    `cost` (`cost_analysis()`'s flops and bytes accessed, or empty); `refused`
    (the TPU compiler's out-of-memory refusal, or None: see the field);
    `host_argument_bytes`, `host_output_bytes`, `host_alias_bytes`,
    `host_temp_bytes` (host memory, what `Plan(offload=...)` moves there) and
    their `host_bytes`; `heap_temp_bytes` (the temporaries as the buffer
    assignment lays them out) and `compiler_peak_bytes` (the compiler's own
    peak), see the fields; `slices`
    and `dcn` (the mesh's slices and the axes across them: what crosses is
    `collectives.dcn_wire_bytes`, its floor `dcn_minimum_wire_bytes`).

    ```python
    report = eqxpar.aot.compile_train_step("llama3-8b", plan, batch=(1, 2048))
    report.fits, report.peak_bytes, report.wire_ratio_to_minimum
    ```
    """

    model: str
    topology: str
    chips: int
    mesh: dict[str, int]
    plan: str
    tokens_per_step: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    memory_per_chip: int | None
    collectives: CollectiveStats
    minimum: Minimum | None
    minimum_note: str
    overlap: OverlapStats
    lower_seconds: float
    compile_seconds: float
    peak_rss_bytes: int
    cost: dict[str, float]
    #: The compiler's refusal (its out-of-memory message) where it refused to
    #: compile: `temp_bytes` is then what it said it needed and
    #: `memory_per_chip` what it had; None when it compiled.
    refused: str | None = None
    #: `memory_analysis()`'s host memory (`pinned_host`) per device: what a plan
    #: offloads (`Plan(offload=...)`), as arguments, outputs, outputs written
    #: over donated arguments, and temporaries (offloaded activations).
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0
    #: The device temporaries as the compiler's buffer assignment lays them out
    #: (its preallocated temp buffer: `memory_analysis()`'s
    #: `total_allocation_bytes - indefinite_allocations`), None where the
    #: installed jaxlib does not say. libtpu 0.0.52's `temp_bytes` is this within
    #: a few KiB; 0.0.50.1's is more than it for a program with loops.
    heap_temp_bytes: int | None = None
    #: The compiler's own peak of device memory over the program (`memory_analysis()`'s
    #: `peak_memory_in_bytes`: arguments and the live temporaries at the busiest
    #: point of its schedule), None where the installed jaxlib does not say. With
    #: libtpu 0.0.50.1 it stays below `peak_bytes` by what that version's
    #: `temp_bytes` adds for loops; MaxText's reference records hold the same field.
    compiler_peak_bytes: int | None = None

    @property
    def host_bytes(self) -> int:
        """Per-device bytes of host memory the step holds at once: arguments,
        outputs not written over a donated argument, and temporaries."""
        return (
            self.host_argument_bytes + self.host_output_bytes - self.host_alias_bytes + self.host_temp_bytes
        )

    #: How many TPU slices the mesh spans, and how many of them each axis that
    #: crosses slices spans (`make_mesh(dcn=...)`; empty inside one slice).
    slices: int = 1
    dcn: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The distinct first replica groups of the collectives inside a slice
    #: (device ids, `a-b` for a run), and the megascale targets of those across
    #: slices (see `eqxpar.inspect.collective_stats`), as the HLO writes them.
    replica_groups: tuple[str, ...] = ()
    dcn_targets: tuple[str, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """Per-device bytes live at the step's peak: arguments, outputs not written
        over a donated argument, and temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool | None:
        """Whether `peak_bytes` fits the chip's memory (None where that is unknown)."""
        return None if self.memory_per_chip is None else self.peak_bytes <= self.memory_per_chip

    @property
    def wire_ratio_to_minimum(self) -> float | None:
        """Wire bytes the compiled step moves / the plan's minimum (None without one)."""
        if self.minimum is None or not self.minimum.total_wire_bytes:
            return None
        return self.collectives.total_wire_bytes / self.minimum.total_wire_bytes

    @property
    def dcn_minimum_wire_bytes(self) -> int:
        """Of the plan's minimum, the collectives over axes that all cross slices
        (HSDP's gradient reduction over `data`): the floor of what crosses."""
        if self.minimum is None or not self.dcn:
            return 0
        return sum(
            cost.wire_bytes
            for cost in self.minimum.costs
            if (axes := [a for a in cost.axes if self.mesh.get(a, 1) > 1]) and set(axes) <= set(self.dcn)
        )

    @property
    def dcn_ratio_to_minimum(self) -> float | None:
        """Wire bytes that cross slices / `dcn_minimum_wire_bytes` (None without one)."""
        least = self.dcn_minimum_wire_bytes
        return self.collectives.total_dcn_wire_bytes / least if least else None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values (for benchmark records)."""
        minimum = self.minimum
        return {
            "refused": self.refused,
            "model": self.model,
            "topology": self.topology,
            "chips": self.chips,
            "mesh": self.mesh,
            "plan": self.plan,
            "tokens_per_step": self.tokens_per_step,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "peak_bytes": self.peak_bytes,
            "host_argument_bytes": self.host_argument_bytes,
            "host_output_bytes": self.host_output_bytes,
            "host_alias_bytes": self.host_alias_bytes,
            "host_temp_bytes": self.host_temp_bytes,
            "host_bytes": self.host_bytes,
            "heap_temp_bytes": self.heap_temp_bytes,
            "compiler_peak_bytes": self.compiler_peak_bytes,
            "memory_per_chip": self.memory_per_chip,
            "fits": self.fits,
            "wire_bytes": dict(self.collectives.wire_bytes),
            "wire_bytes_by_axes": {
                kind: {",".join(axes) or "-": n for axes, n in by.items()}
                for kind, by in self.collectives.by_axes.items()
            },
            "total_wire_bytes": self.collectives.total_wire_bytes,
            "minimum_wire_bytes": None if minimum is None else minimum.total_wire_bytes,
            "wire_ratio_to_minimum": self.wire_ratio_to_minimum,
            "slices": self.slices,
            "dcn": self.dcn,
            "dcn_wire_bytes": dict(self.collectives.dcn_wire_bytes),
            "total_dcn_wire_bytes": self.collectives.total_dcn_wire_bytes,
            "dcn_wire_bytes_by_axes": {
                kind: {",".join(axes) or "-": n for axes, n in by.items()}
                for kind, by in self.collectives.dcn_by_axes.items()
            },
            "ici_replica_groups": list(self.replica_groups),
            "dcn_targets": list(self.dcn_targets),
            "dcn_minimum_wire_bytes": self.dcn_minimum_wire_bytes,
            "dcn_ratio_to_minimum": self.dcn_ratio_to_minimum,
            "async_wire_bytes": self.overlap.async_wire_bytes,
            "async_share": self.overlap.share,
            "lower_seconds": round(self.lower_seconds, 2),
            "compile_seconds": round(self.compile_seconds, 2),
            "peak_rss_bytes": self.peak_rss_bytes,
            "cost": self.cost,
        }

    def __str__(self) -> str:
        mesh = " x ".join(f"{a} {n}" for a, n in self.mesh.items() if n > 1) or "one device"
        if self.slices > 1:
            mesh += f"; {self.slices} slices: " + ", ".join(f"{a} over {n}" for a, n in self.dcn.items())
        fits = {None: "unknown (no memory figure for this device)", True: "fits", False: "DOES NOT FIT"}
        memory = "?" if self.memory_per_chip is None else _gib(self.memory_per_chip)
        sizes = [self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes, self.peak_bytes]
        lines = [
            f"{self.model} on {self.topology} ({self.chips} chips, {mesh}), {self.plan}, "
            f"{fmt_int(self.tokens_per_step)} tokens per step",
            "",
            "memory per device",
            render(
                ["argument", "output", "alias", "temp", "peak", "device memory"],
                [[*map(_gib, sizes), memory]],
                right=[True] * 6,
            ),
            f"-> {fits[self.fits]}"
            + ("" if self.refused is None else f" (the compiler refused it: {self.refused})"),
            *self._host_lines(),
            "",
            "collectives per device per step (wire bytes; a loop's collectives once per trip)",
            render(
                ["kind", "mesh axes", "wire", "minimum"],
                self._collective_rows(),
                right=[False, False, True, True],
            ),
            f"measured / minimum: {fmt_ratio(self.wire_ratio_to_minimum)} ({self.minimum_note})",
            *self._dcn_lines(),
            "scheduled asynchronously (compute between start and done): "
            + (
                ", ".join(f"{k} {self.overlap.kind_share(k):.0%}" for k in self.overlap.by_kind)
                or "nothing moves"
            )
            + f"; {self.overlap.share:.0%} of all wire bytes",
            "",
            f"compile: lower {self.lower_seconds:.1f} s + compile {self.compile_seconds:.1f} s; "
            f"peak RSS of this process {_gib(self.peak_rss_bytes)}",
        ]
        if self.cost:
            cost = ", ".join(f"{k} {v:.3e}" for k, v in self.cost.items())
            lines.append(f"cost: {cost} ({COST_CAVEAT})")
        return "\n".join(lines)

    def _host_lines(self) -> list[str]:
        if not self.host_bytes:
            return []
        sizes = [
            self.host_argument_bytes,
            self.host_output_bytes,
            self.host_alias_bytes,
            self.host_temp_bytes,
        ]
        return [
            "",
            "host memory per device (offloaded: pinned_host)",
            render(
                ["argument", "output", "alias", "temp", "held"],
                [[*map(_gib, sizes), _gib(self.host_bytes)]],
                right=[True] * 5,
            ),
        ]

    def _dcn_lines(self) -> list[str]:
        if self.slices <= 1:
            return []
        kinds = ", ".join(f"{k} {fmt_int(n)}" for k, n in self.collectives.dcn_wire_bytes.items() if n)
        return [
            f"across slices (DCN): {fmt_int(self.collectives.total_dcn_wire_bytes)} ({kinds or 'nothing'}); "
            f"minimum over {','.join(self.dcn)} {fmt_int(self.dcn_minimum_wire_bytes)}: "
            f"{fmt_ratio(self.dcn_ratio_to_minimum)}"
        ]

    def _collective_rows(self) -> list[list[str]]:
        """One row per (kind, mesh axes) measured or in the minimum, then the total."""
        least: dict[tuple[str, tuple[str, ...]], int] = {}
        for cost in () if self.minimum is None else self.minimum.costs:
            key = (cost.kind, tuple(a for a in cost.axes if self.mesh.get(a, 1) > 1))
            least[key] = least.get(key, 0) + cost.wire_bytes
        measured = {
            (k, axes): wire for k, by in self.collectives.by_axes.items() for axes, wire in by.items()
        }
        rows = [
            [
                kind,
                ",".join(axes) or "-",
                fmt_int(measured.get((kind, axes), 0)),
                fmt_int(least.get((kind, axes), 0)),
            ]
            for kind, axes in sorted(
                set(measured) | set(least),
                key=lambda k: (_KINDS.index(k[0]) if k[0] in _KINDS else len(_KINDS), k[1]),
            )
        ]
        total = self.minimum.total_wire_bytes if self.minimum is not None else None
        rows.append(
            [
                "total",
                "",
                fmt_int(self.collectives.total_wire_bytes),
                "n/a" if total is None else fmt_int(total),
            ]
        )
        return rows
