"""`Schedule`: a pipeline schedule as data, a table (tick, device) ->
(micro-batch, chunk, action), and what follows from it: its entries in run
order, the bubble fractions, the engine's buffer slots and a text rendering.
Shared with `eqxpar._plan` (which accepts a `Plan(schedule=...)` table of this
type); the public name is `eqxpar.pipeline.Schedule`.

A schedule is built from one *order* per device (the sequence of actions that
device runs): the built-in ones by `schedule` (`_builtin`), a user's by
`Schedule.from_orders`; the ticks follow from the orders (`_ticks`). A user's
table comes in through `Schedule.from_table`. `_picture` draws a schedule.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import PipelineScheduleError
from ._actions import ACTION_LETTERS, COSTS, IDLE
from ._buffers import Buffers, allocate_buffers
from ._placement import virtual_stage_of
from ._table_checks import as_orders, check_counts, check_schedule, check_units, parse_action
from ._ticks import place_ticks
from ._timeline import Simulation, run_times


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: what every device does at every tick.

    Built by `eqxpar.pipeline.schedule`, or from a user's table or per-device
    orders by `Schedule.from_table` / `Schedule.from_orders` (validated there).
    The engine (`Plan(schedule=...)`, a name or a `Schedule` object) runs one
    tick per step of a `lax.scan`, every device following its column.

    **Attributes:**

    - `name`, `stages` (devices along `pipe`), `microbatches`, `chunks` (virtual
      stages per device).
    - `table`: int32 numpy array `(ticks, stages, 3)`: `[tick, device] = (micro-batch,
      chunk, action)`, action codes `0` idle, `1` forward, `2` backward, `3`
      backward-input, `4` backward-weight (`ACTION_NAMES`); micro-batch and chunk
      are -1 where idle.
    - `placement`: `"interleaved"` (virtual stage `chunk * stages + device`) or
      `"v"` (with two chunks, device `d` holds stages `d` and `2 * stages - 1 -
      d`: ZB-V, DualPipeV; the stage `stages - 1` hands stage `stages` its
      activation on the device, and device 0 runs the first and the last
      stage). The engine runs both. See `stage_of`.
    - `fused`: None, or a second table of the same shape: the action each device
      runs in a tick after `table`'s (idle where none). A fused tick pairs a
      forward with a backward-direction action (one send each way per tick
      still does), so that in one SPMD program the devices of a tick run work of
      the same cost: `"1f1b"` and `"interleaved"` are built so (in their steady
      state every device runs one forward and one backward per tick).
    - `bubble_fraction`: the idle share of the devices' time when each runs its
      actions in table order as soon as their inputs are there, under the cost
      model forward = 1, backward = 2, backward-input = 1, backward-weight = 1
      (`COSTS`; `eqxpar.pipeline.simulate` takes measured times instead).
    - `lockstep_bubble_fraction`: the same in one SPMD program, where all devices
      run each tick together, so a tick takes as long as the costliest action any
      device runs in it.
    - `in_flight`: the most stage inputs (activations received from the previous
      stage and kept until their backward pass) any device holds at once: the
      length of the engine's activation buffer. `cotangent_slots`: the same for
      received cotangents.

    `str(schedule)` renders the table as text, one row per device (`F3` forward of
    micro-batch 3, `B` backward, `I` backward-input, `W` backward-weight, `.` idle;
    with chunks, `F3:1` is chunk 1).

    ```python
    s = eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=8)
    print(s)                         # the table
    s.bubble_fraction                # 3 / 11
    ```
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    table: np.ndarray
    placement: str = "interleaved"
    fused: np.ndarray | None = None

    @classmethod
    def from_table(
        cls,
        # `Any` for the arguments validated below (PipelineScheduleError names them).
        table: Any,
        *,
        stages: Any,
        microbatches: Any,
        chunks: Any = 1,
        name: str = "custom",
        placement: Any = "interleaved",
    ) -> "Schedule":
        """A schedule from a hand-written table, validated (see `validate`).

        **Arguments:**

        - `table`: integers of shape `(ticks, stages, 3)`: `[tick, device] =
          (micro-batch, chunk, action)` with action codes `0` idle, `1` forward,
          `2` backward, `3` backward-input, `4` backward-weight. Micro-batch and
          chunk of idle cells are ignored (stored as -1). An activation or
          cotangent sent at the end of tick `t` is usable from tick `t + 1`.
        - `stages`, `microbatches`, `chunks`: the counts the table is for.
        - `name`: shown by `str()` and in errors.
        - `placement`: `"interleaved"` or `"v"` (two chunks per device, device
          `d` holding virtual stages `d` and `2 * stages - 1 - d`).

        **Returns:** a read-only `Schedule`, accepted by `Plan(schedule=...)` when
        its stages equal the `pipe` size (and, in a V placement, it has two
        chunks).

        **Raises:** `PipelineScheduleError` naming the tick and device of the first
        problem.

        ```python
        F, B = 1, 2
        t = [[(0, 0, F), (-1, -1, 0)],      # tick 0: device 0 forwards mb 0
             [(1, 0, F), (0, 0, F)],        # tick 1
             [(-1, -1, 0), (0, 0, B)],      # tick 2: the last stage's backward
             [(0, 0, B), (1, 0, F)],
             [(-1, -1, 0), (1, 0, B)],
             [(1, 0, B), (-1, -1, 0)]]
        s = eqxpar.pipeline.Schedule.from_table(t, stages=2, microbatches=2)
        ```
        """
        check_counts("Schedule.from_table", stages, microbatches, chunks, placement)
        stages, microbatches, chunks = int(stages), int(microbatches), int(chunks)
        where = f"Schedule.from_table(name={name!r})"
        try:
            array = np.asarray(table)
        except (TypeError, ValueError) as err:
            raise PipelineScheduleError(
                f"{where}: the table is not a rectangular array of integers ({err}). Give an int "
                f"array of shape (ticks, {stages}, 3)."
            ) from None
        if not np.issubdtype(array.dtype, np.integer):
            raise PipelineScheduleError(
                f"{where}: the table has dtype {array.dtype}; expected integers (micro-batch, chunk, "
                "action code). Build it with np.asarray(..., dtype=np.int32)."
            )
        if array.ndim != 3 or array.shape[1:] != (stages, 3) or array.shape[0] == 0:
            raise PipelineScheduleError(
                f"{where}: the table has shape {array.shape}; expected (ticks, {stages}, 3) with at "
                "least one tick: [tick, device] = (micro-batch, chunk, action)."
            )
        array = array.astype(np.int32)
        idle = array[..., 2] == IDLE
        array[idle, 0] = -1
        array[idle, 1] = -1
        array.setflags(write=False)
        out = cls(name, stages, microbatches, chunks, array, placement)
        check_schedule(out)
        return out

    @classmethod
    def from_orders(
        cls,
        # `Any` for the arguments validated below (PipelineScheduleError names them).
        orders: Any,
        *,
        microbatches: Any,
        chunks: Any = 1,
        name: str = "custom",
        placement: Any = "interleaved",
    ) -> "Schedule":
        """A schedule from the order in which each device runs its actions.

        Each action is placed one tick after the later of the device's previous
        action and the actions it depends on (as the built-in schedules are).

        **Arguments:**

        - `orders`: one sequence per device (so `stages = len(orders)`) of actions,
          each a string `"F3"` (forward of micro-batch 3), `"B3"`, `"I3"`, `"W3"`,
          with `":1"` for chunk 1 (`"F3:1"`), or a tuple `(letter or action code,
          micro-batch)` or `(letter or code, micro-batch, chunk)`.
        - `microbatches`, `chunks`, `name`, `placement`: as for `from_table`.

        **Returns:** a validated `Schedule`.

        **Raises:** `PipelineScheduleError` for a malformed action (naming device
        and position), an action twice or missing, or orders that deadlock
        (naming each device and the action it is blocked on).

        ```python
        s = eqxpar.pipeline.Schedule.from_orders(
            [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], microbatches=2)
        ```
        """
        where = f"Schedule.from_orders(name={name!r})"
        if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence) or not orders:
            raise PipelineScheduleError(
                f"{where}: orders={orders!r}; expected a non-empty sequence with one sequence of "
                'actions per device, e.g. [["F0", "B0"], ["F0", "B0"]].'
            )
        p = len(orders)
        check_counts("Schedule.from_orders", p, microbatches, chunks, placement)
        microbatches, chunks = int(microbatches), int(chunks)
        parsed = [
            [parse_action(a, device, i, microbatches, chunks, where) for i, a in enumerate(order)]
            for device, order in enumerate(as_orders(orders, where))
        ]
        units = [
            (f"device {d}, position {i} of its order", mb, virtual_stage_of(d, chunk, p, placement), kind)
            for d, order in enumerate(parsed)
            for i, (kind, mb, chunk) in enumerate(order)
        ]
        check_units(units, p, microbatches, chunks, placement, where)
        table, _ = place_ticks(parsed, p, p * chunks, placement)
        table.setflags(write=False)
        out = cls(name, p, microbatches, chunks, table, placement)
        check_schedule(out)
        return out

    def validate(self) -> None:
        """Raise `PipelineScheduleError` unless the table is runnable (see `validate`)."""
        check_schedule(self)

    @property
    def virtual_stages(self) -> int:
        """Number of virtual stages: `stages * chunks`."""
        return self.stages * self.chunks

    @property
    def ticks(self) -> int:
        """Number of ticks (rows of the table)."""
        return int(self.table.shape[0])

    def stage_of(self, device: int, chunk: int) -> int:
        """The virtual stage that `chunk` of `device` runs (see `placement`)."""
        return virtual_stage_of(device, chunk, self.stages, self.placement)

    def entries(self) -> list[tuple[int, int, int, int, int]]:
        """Every non-idle entry as `(tick, device, micro-batch, virtual stage, action)`,
        in the order the devices run them (by tick; in a fused tick, `table`'s
        action before `fused`'s)."""
        out = []
        tables = (self.table,) if self.fused is None else (self.table, self.fused)
        p, placement = self.stages, self.placement
        for tick in range(self.ticks):
            for device in range(self.stages):
                for table in tables:
                    mb, chunk, kind = (int(x) for x in table[tick, device])
                    if kind != IDLE:
                        # (not self.stage_of: a checked call per entry, in the simulator's loop)
                        out.append((tick, device, mb, virtual_stage_of(device, chunk, p, placement), kind))
        return out

    @functools.cached_property
    def _unit_simulation(self) -> Simulation:
        # `simulate` under the unit costs `COSTS`, which need no checking.
        unit = {code: float(cost) for code, cost in enumerate(COSTS)}
        return run_times(self, unit, dict.fromkeys(unit, 0.0), 0.0)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of device time, devices running independently (see class doc)."""
        return self._unit_simulation.bubble_fraction

    @property
    def lockstep_bubble_fraction(self) -> float:
        """Idle share of device time when every tick lasts as long as its costliest action."""
        return self._unit_simulation.lockstep_bubble_fraction

    @functools.cached_property
    def buffers(self) -> Buffers:
        """The engine's buffer slots (see `Buffers`)."""
        return allocate_buffers(self)

    @property
    def in_flight(self) -> int:
        """Length of the activation buffer: most stage inputs held at once by a device."""
        return self.buffers.inputs

    @property
    def cotangent_slots(self) -> int:
        """Length of the cotangent buffer: most received cotangents held at once."""
        return self.buffers.cotangents

    def __str__(self) -> str:
        cells = []
        second = self.fused if self.fused is not None else np.full_like(self.table, IDLE)
        for device in range(self.stages):
            row = []
            for (mb, chunk, kind), (mb2, chunk2, kind2) in zip(
                self.table[:, device], second[:, device], strict=True
            ):
                names = [
                    f"{ACTION_LETTERS[k]}{b}" + (f":{c}" if self.chunks > 1 else "")
                    for b, c, k in ((mb, chunk, kind), (mb2, chunk2, kind2))
                    if k != IDLE
                ]
                row.append("+".join(names) or ".")
            cells.append(row)
        width = max(len(c) for row in cells for c in row)
        where = ", V placement" if self.placement == "v" else ""
        head = (
            f"{self.name}: {self.stages} stages x {self.chunks} chunk(s){where}, {self.microbatches} "
            f"micro-batches, {self.ticks} ticks; bubble {self.bubble_fraction:.1%} "
            f"(lockstep {self.lockstep_bubble_fraction:.1%}); in flight {self.in_flight}"
        )
        lines = [head]
        for device, row in enumerate(cells):
            lines.append(f"dev{device:<3d}" + " ".join(c.rjust(width) for c in row))
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = f", placement={self.placement!r}" if self.placement != "interleaved" else ""
        return (
            f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"chunks={self.chunks}, ticks={self.ticks}{where})"
        )
