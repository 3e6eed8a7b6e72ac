"""A PNG picture of a schedule table (matplotlib, imported only when asked for)."""

import os

from .._errors import EqxparError
from ._actions import ACTION_LETTERS, IDLE
from ._schedule import Schedule

# Colour per action: forward, backward, backward-input, backward-weight.
_COLOURS = {1: "#4c72b0", 2: "#dd8452", 3: "#c44e52", 4: "#55a868"}


def save_schedule_png(schedule: Schedule, path: str | os.PathLike) -> None:
    """Draw a schedule as a grid (devices down, ticks across) and save it as PNG.

    Each cell is coloured by action (forward blue, backward orange,
    backward-input red, backward-weight green; idle white) and labelled with the
    micro-batch (and `:chunk` with several chunks). The title gives the bubble
    fractions.

    **Arguments:** `schedule` (from `eqxpar.pipeline.schedule`), `path` of the PNG.

    **Raises:** `EqxparError` when matplotlib is missing (`pip install eqxpar[examples]`).

    ```python
    eqxpar.pipeline.save_schedule_png(eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=8), "1f1b.png")
    ```
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise EqxparError(
            "save_schedule_png needs matplotlib, which is not installed. Install the examples "
            "extra: pip install eqxpar[examples]"
        ) from e
    table = schedule.table
    ticks, devices = table.shape[:2]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * ticks + 1.5), 0.45 * devices + 1.2))
    for tick in range(ticks):
        for device in range(devices):
            cells = [table[tick, device]] + (
                [schedule.fused[tick, device]] if schedule.fused is not None else []
            )
            cells = [tuple(int(x) for x in c) for c in cells if int(c[2]) != IDLE]
            # A fused tick's two actions share the cell: first on the top half.
            height = 1.0 / max(len(cells), 1)
            for i, (mb, chunk, kind) in enumerate(cells):
                top = device + i * height
                ax.add_patch(
                    Rectangle(
                        (tick, top), 1, height, facecolor=_COLOURS[kind], edgecolor="white", linewidth=0.5
                    )
                )
                label = f"{ACTION_LETTERS[kind]}{mb}" + (f":{chunk}" if schedule.chunks > 1 else "")
                ax.text(
                    tick + 0.5, top + height / 2, label, ha="center", va="center", fontsize=6, color="white"
                )
    ax.set_xlim(0, ticks)
    ax.set_ylim(devices, 0)
    ax.set_yticks([d + 0.5 for d in range(devices)], [f"device {d}" for d in range(devices)])
    ax.set_xlabel("tick")
    ax.set_title(
        f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches"
        + (f", {schedule.chunks} chunks" if schedule.chunks > 1 else "")
        + f"; bubble {schedule.bubble_fraction:.1%} (lockstep {schedule.lockstep_bubble_fraction:.1%})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
