"""`schedule`: the built-in pipeline schedules by name, built from their
per-device orders (`_orders`) and placed on ticks (`_ticks`)."""

import functools

from .._errors import PlanError
from .._plan import PIPELINE_SCHEDULES, V_SCHEDULES
from ._actions import FORWARD
from ._orders import (
    orders_1f1b_fused,
    orders_dualpipe_v,
    orders_gpipe,
    orders_interleaved,
    orders_zb_v,
    orders_zero_bubble,
)
from ._schedule import Schedule
from ._ticks import place_ticks


def schedule(name: str, *, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build a pipeline schedule table.

    **Arguments:**

    - `name`: `"gpipe"` (all forwards, then all backwards: `microbatches`
      activations per stage in flight), `"1f1b"` (after a warm-up, one forward then
      one backward: at most `stages` in flight), `"interleaved"` (1F1B over
      `chunks` virtual stages per device: the bubble shrinks by `chunks`; the
      last virtual stage's last `stages - 1` backwards are split, their weight
      halves run while the last device would idle at the end),
      `"zero_bubble"` (ZB-H1: backward split into input- and weight-gradient
      passes, the weight passes filling 1F1B's bubble at 1F1B's memory). In a V
      placement (two chunks per device, device `d` holding virtual stages `d`
      and `2 stages - 1 - d`, so device 0 runs the first and the last):
      `"zb_v"` (ZB-V: backward split, 1F1B's memory) and `"dualpipe_v"`
      (DeepSeek's DualPipeV as a table; `microbatches >= 2 * stages`).
    - `stages`: devices along the `pipe` axis.
    - `microbatches`: micro-batches per step (for `"interleaved"` with
      `chunks > 1`, a multiple of `stages`).
    - `chunks`: virtual stages per device; only `"interleaved"` takes more than 1
      (`"zb_v"` and `"dualpipe_v"` always have 2: leave it out or pass 2).

    **Returns:** a `Schedule`.

    **Raises:** `PlanError` for an unknown name, non-positive counts, chunks with a
    non-interleaved schedule, or interleaved micro-batches not a multiple of stages.

    ```python
    s = eqxpar.pipeline.schedule("interleaved", stages=4, microbatches=8, chunks=2)
    s.bubble_fraction      # 0.127, under Megatron's (4 - 1) / (2 * 8 + 4 - 1)
    eqxpar.pipeline.schedule("zb_v", stages=4, microbatches=16).bubble_fraction
    ```
    """
    names = PIPELINE_SCHEDULES
    if name not in names:
        raise PlanError(f"schedule(name={name!r}): unknown schedule; expected one of {names}.")
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"schedule({what}={value!r}): expected a positive integer.")
    if name in V_SCHEDULES:
        if chunks not in (1, 2):
            raise PlanError(
                f"schedule({name!r}, chunks={chunks}): {name!r} always runs two chunks per device "
                "(a V: device d holds virtual stages d and 2p-1-d). Leave chunks out or pass chunks=2."
            )
        if name == "dualpipe_v" and microbatches < 2 * stages:
            raise PlanError(
                f"schedule('dualpipe_v', stages={stages}, microbatches={microbatches}): DualPipeV "
                f"needs at least 2 * stages = {2 * stages} micro-batches. Use microbatches >= "
                f"{2 * stages}."
            )
        return _build(name, stages, microbatches, 2)
    if chunks > 1 and name != "interleaved":
        raise PlanError(
            f"schedule({name!r}, chunks={chunks}): only the 'interleaved' schedule runs several "
            "chunks (virtual stages) per device. Use name='interleaved' or chunks=1."
        )
    if name == "interleaved" and chunks > 1 and microbatches % stages:
        raise PlanError(
            f"schedule('interleaved', stages={stages}, microbatches={microbatches}, chunks={chunks}): "
            f"the interleaved schedule sends micro-batches through each chunk in groups of {stages}; "
            f"use a number of micro-batches that is a multiple of {stages}."
        )
    return _build(name, stages, microbatches, chunks)


@functools.lru_cache(maxsize=256)
def _build(name: str, p: int, m: int, v: int) -> Schedule:
    placement = "interleaved"
    if name == "gpipe":
        orders = orders_gpipe(p, m)
    elif name == "1f1b":
        orders = orders_1f1b_fused(p, m)
    elif name == "interleaved":
        orders = orders_interleaved(p, m, v)
    elif name == "zero_bubble":
        orders = orders_zero_bubble(p, m)
    elif name == "zb_v":
        orders, placement = orders_zb_v(p, m), "v"
    else:
        orders, placement = orders_dualpipe_v(p, m), "v"
    # 1F1B and interleaved fuse a forward and a backward into one tick, so that a
    # tick's devices run work of one cost in one SPMD program (see `Schedule`).
    fuse = name in ("1f1b", "interleaved")
    table, fused = place_ticks(orders, p, p * v, placement, fuse=fuse)
    table.setflags(write=False)
    if fused is not None:
        fused.setflags(write=False)
    return Schedule(
        name=name, stages=p, microbatches=m, chunks=v, table=table, placement=placement, fused=fused
    )


def forward_only(sched: Schedule) -> Schedule:
    """`sched`'s forward actions alone, each device running its forwards in the
    order `sched` gives them, placed on ticks as soon as their inputs arrive:
    what `eqxpar.train.make_eval_step` runs (no backward, nothing kept for one).

    **Arguments:** `sched`, any `Schedule` (built-in or from a table).

    **Returns:** a `Schedule` of the same stages, micro-batches, chunks and
    placement, with forward actions only.

    ```python
    s = eqxpar.pipeline.forward_only(eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=8))
    print(s)   # GPipe's forward phase: F0 .. F7 down the devices
    ```
    """
    orders = []
    tables = [sched.table] + ([sched.fused] if sched.fused is not None else [])
    for device in range(sched.stages):
        actions = [
            (tick, i, (int(t[tick, device, 0]), int(t[tick, device, 1])))
            for i, t in enumerate(tables)
            for tick in range(t.shape[0])
            if t[tick, device, 2] == FORWARD
        ]
        orders.append([(FORWARD, mb, chunk) for _, _, (mb, chunk) in sorted(actions)])
    p, v = sched.stages, sched.chunks
    table, _ = place_ticks(orders, p, p * v, sched.placement)
    table.setflags(write=False)
    return Schedule(
        name=f"{sched.name} (forward only)",
        stages=p,
        microbatches=sched.microbatches,
        chunks=v,
        table=table,
        placement=sched.placement,
    )
