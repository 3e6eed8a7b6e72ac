"""A PNG picture of a schedule table (matplotlib, imported only when asked for)."""

import os

from .._errors import EqxparError
from ._schedule import ACTION_LETTERS, IDLE, Schedule

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
            mb, chunk, kind = (int(x) for x in table[tick, device])
            if kind == IDLE:
                continue
            ax.add_patch(
                Rectangle((tick, device), 1, 1, facecolor=_COLOURS[kind], edgecolor="white", linewidth=0.5)
            )
            label = f"{ACTION_LETTERS[kind]}{mb}" + (f":{chunk}" if schedule.chunks > 1 else "")
            ax.text(tick + 0.5, device + 0.5, label, ha="center", va="center", fontsize=6, color="white")
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
