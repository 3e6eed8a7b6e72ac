"""Metric trackers: one small interface, `tracker.log(metrics, step)`, with a
JSON-lines writer and TensorBoard event files."""

import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from ._errors import EqxparError

#: Arrays up to this many elements are written whole to JSON lines; larger ones
#: would bloat every line, and are left out (TensorBoard takes scalars only).
MAX_LOGGED_ELEMENTS = 64


@runtime_checkable
class Tracker(Protocol):
    """What a training loop logs to: `log(metrics, step)` and `close()`.

    `metrics` is any nested mapping (or pytree) of scalars and small arrays, as a
    step returns them; keys of nested levels join with `/` (`aux/router_z`).
    """

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def flatten_metrics(metrics: Any) -> dict[str, float | list]:
    """`metrics` as `{"a/b": value}`: scalars as floats (int and bool as ints),
    arrays of at most `MAX_LOGGED_ELEMENTS` elements as nested lists, larger ones
    and non-numbers left out. Fetches device arrays to the host."""
    out: dict[str, float | list] = {}
    leaves = jax.tree_util.tree_flatten_with_path(metrics)[0]
    for path, leaf in leaves:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        try:
            value = np.asarray(leaf)
        except (TypeError, ValueError):
            continue
        if value.dtype.kind not in "biuf" or value.size > MAX_LOGGED_ELEMENTS:
            continue
        if value.ndim == 0:
            out[name] = int(value) if value.dtype.kind in "biu" else float(value)
        else:
            out[name] = value.tolist()
    return out


def _writes() -> bool:
    # One writer per job: process 0 (the others hold the same metrics).
    return jax.process_index() == 0


class JsonLinesTracker:
    """Appends one JSON object per `log` call to `path`: `{"step": step, **metrics}`
    (flattened by `flatten_metrics`; NaN and inf written as strings, as JSON has
    none). Only process 0 writes.

    **Arguments:** `path`, the file (its directory is made; an existing file is
    appended to, so a restarted run continues it).

    ```python
    tracker = eqxpar.train.JsonLinesTracker("runs/metrics.jsonl")
    tracker.log(metrics, step=100)
    ```
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._file = None
        if _writes():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._file is None:
            return

        def finite(x: Any) -> Any:
            if isinstance(x, list):
                return [finite(v) for v in x]
            return str(x) if isinstance(x, float) and not math.isfinite(x) else x

        record = {"step": int(step), **{k: finite(v) for k, v in flatten_metrics(metrics).items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker:
    """Writes each scalar of `log`'s metrics as a TensorBoard scalar summary under
    `log_dir` (event files `tensorboard --logdir` reads). Only process 0 writes.
    Needs `tensorboardX` (`pip install eqxpar[tracking]`).

    **Arguments:** `log_dir`, the directory of the event files.

    ```python
    tracker = eqxpar.train.TensorBoardTracker("runs/tb")
    tracker.log({"loss": 2.1, "lr": 1e-3}, step=100)
    ```
    """

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise EqxparError(
                "TensorBoardTracker needs the tensorboardX package: pip install 'eqxpar[tracking]' (or "
                "tensorboardX), or log with eqxpar.train.JsonLinesTracker."
            ) from e
        self.log_dir = pathlib.Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir)) if _writes() else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._writer is None:
            return
        for name, value in flatten_metrics(metrics).items():
            if not isinstance(value, list):
                self._writer.add_scalar(name, value, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Trackers:
    """Several trackers as one: `log` and `close` go to each in turn.

    ```python
    tracker = eqxpar.train.Trackers([JsonLinesTracker("m.jsonl"), TensorBoardTracker("tb")])
    ```
    """

    # Any: checked below, with an eqxpar error that names the value.
    def __init__(self, trackers: Sequence[Any]):
        for t in trackers:
            if not isinstance(t, Tracker):
                raise EqxparError(
                    f"Trackers: {t!r} has no log(metrics, step) and close(); expected eqxpar.train trackers "
                    "or objects with those two methods."
                )
        self.trackers = list(trackers)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
