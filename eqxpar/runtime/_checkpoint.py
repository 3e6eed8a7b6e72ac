"""Sharded, asynchronous, atomic checkpoints of a train state, on orbax-checkpoint.

Only arrays go into the files: each process writes the shards it holds, and a
restore reads only the shards the target plan puts on this process, so a state
saved under one mesh restores under another. Everything that is not an array (the
model's structure, activation functions, static fields) comes from the `like`
template at restore time: nothing is pickled. Beside the arrays a small JSON item
records each array leaf's path, shape and dtype (checked against the template, so
a checkpoint of another model fails with a clear error) and the data iterator's
position.
"""

import json
import logging
import os
import pathlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from .._errors import EqxparError
from .._plan import Plan
from .._stack_order import describe_order, in_natural_order, in_plan_order
from .._train._resolved_plan import ResolvedPlan
from .._train._train_state import TrainState
from .._train._train_state import shardings_of as state_shardings
from ..nn._stack import Stacked
from ._distributed import get_logger

_FORMAT = "eqxpar.checkpoint"
# 2: every layer stack (`eqxpar.nn.Stacked`) in natural order, whatever plan saved
# it. 1 recorded no order: eqxpar 0.1.0 wrote a stack as the model held it (a
# pipeline plan's order, reordered by hand), later version-1 files natural order.
_VERSION = 2
_READABLE = (1, 2)
#: What `restore(stored_order=...)` takes besides an `eqxpar.Plan`.
_STORED_ORDERS = ("natural", "plan")
_ARRAYS = "state"
_META = "eqxpar"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_ON_SAVE_ERROR = ("raise", "warn")
_LOGGER = logging.getLogger("eqxpar.checkpoint")


class CheckpointError(EqxparError):
    """A checkpoint cannot be saved or restored (missing, corrupt, foreign, mismatched)."""


def _orbax() -> ModuleType:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointError(
            "eqxpar.checkpoint needs orbax-checkpoint, which is not installed. Install it "
            "with `pip install eqxpar[checkpoint]` (or `pip install orbax-checkpoint`)."
        ) from e
    return ocp


def _is_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _array_leaves(tree: PyTree) -> list[tuple[str, Any]]:
    """`(path, leaf)` for every array leaf, in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat if _is_array(leaf)]


def _name(i: int) -> str:
    return f"leaf_{i:05d}"


class CheckpointManager:
    """Save and restore a train state every few steps, keeping the last few.

    Each `save` writes one step's checkpoint into `directory/<step>`: the arrays
    of the state (each process writes only its own shards, in the background),
    and a JSON record of the leaves and of `data_state`. A checkpoint becomes
    visible only when complete (orbax writes into a temporary directory and
    renames it), so a crash during a save leaves the previous one loadable.

    All processes of a run must call `save`, `wait` and `restore` together, with
    the same arguments.

    **Arguments:**

    - `directory`: where the checkpoints live (created if missing; on a
      filesystem all processes share).
    - `max_to_keep`: keep the newest this many complete checkpoints (None: keep
      all). Incomplete step directories are not counted, nor deleted.
    - `keep_every`: also keep, for good, every checkpoint whose step is a
      multiple of this (None: only the newest `max_to_keep`). Needs `max_to_keep`.
    - `async_save`: write in a background thread; `save` returns once the arrays
      are copied off the devices (so the next train step may overwrite them).
    - `on_save_error`: what a save that fails does, whether it fails in `save`
      itself (say, the directory cannot be written) or in the background (the
      disk fills up). `"warn"` (default): log a warning naming the step and the
      error (logger `eqxpar.checkpoint`, with the process's `[rank k/n]`) and go
      on, so that a long run survives a passing fault; a failed save leaves no
      complete checkpoint, so `restore` still loads the latest complete one. A
      failure before this manager has completed any save still raises: that is
      a set-up error (a path that cannot be written), which a run should not
      carry on without checkpoints. `"raise"`: always raise a `CheckpointError`
      (from `save`, or, for a background failure, from the next `save`, `wait`,
      `restore` or `close`).

    ```python
    manager = eqxpar.checkpoint.CheckpointManager("ckpt", max_to_keep=3)
    if manager.latest_step() is not None:
        state, data_state = manager.restore(like=state, plan=plan)
    ...
    manager.save(int(state.step), state, data_state=iterator.get_state())
    manager.wait()                     # before exiting
    ```
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        on_save_error: str = "warn",
    ):
        ocp = _orbax()
        _check_retention(max_to_keep, keep_every)
        if on_save_error not in _ON_SAVE_ERROR:
            raise CheckpointError(
                f"CheckpointManager(on_save_error={on_save_error!r}): expected one of {_ON_SAVE_ERROR}: "
                "'raise' to stop on a failed save, 'warn' to log it and go on."
            )
        self._on_save_error = on_save_error
        # The step whose background save may still be running (and fail).
        self._pending: int | None = None
        # Whether a save of this manager has completed (a failure before one raises).
        self._saved_once = False
        self._directory = pathlib.Path(directory).absolute()
        if self._directory.exists() and not self._directory.is_dir():
            raise CheckpointError(
                f"CheckpointManager: {str(self._directory)!r} exists and is not a directory. "
                "Give a directory path for the checkpoints."
            )
        options = ocp.CheckpointManagerOptions(
            # orbax's own max_to_keep would count incomplete step directories too,
            # and delete complete checkpoints to make room for them.
            preservation_policy=None
            if max_to_keep is None
            else _KeepLatest(self._directory, max_to_keep, keep_every),
            enable_async_checkpointing=bool(async_save),
            create=True,
            # Leftovers of saves that crashed midway are never loadable; drop them.
            cleanup_tmp_directories=True,
            # A step's directory is made in `save` itself, so that a directory that
            # cannot be written fails there. Made in the background, its failure
            # leaves orbax's writer threads waiting minutes for the directory, and
            # the process hangs at exit (threading's shutdown joins them).
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self._ocp = ocp
        self._manager = _guard(
            lambda: ocp.CheckpointManager(self._directory, options=options, item_names=(_ARRAYS, _META)),
            f"opening checkpoint directory {str(self._directory)!r}",
            "check that the path is a writable directory.",
        )

    @property
    def directory(self) -> pathlib.Path:
        """The checkpoint directory (absolute)."""
        return self._directory

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints in the directory, oldest first.

        A step directory counts once it holds both parts of an eqxpar checkpoint
        (the arrays and the JSON record), each non-empty: an empty or half-copied
        `<step>/` directory, or one another tool wrote, does not.

        ```python
        manager.all_steps()          # [10, 20, 30]
        ```
        """
        return [s for s in self._step_dirs() if _is_complete(self._directory / str(s))]

    def _step_dirs(self) -> list[int]:
        # Every step directory orbax knows of, complete or not.
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none.

        ```python
        if manager.latest_step() is not None:
            state, data_state = manager.restore(like=state, plan=plan)
        ```
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: PyTree, *, data_state: dict[str, Any] | None = None) -> None:
        """Start saving `state` (and the data position) as checkpoint `step`.

        Returns once the arrays are copied off the devices; the files are written
        in the background (call `wait()` before reading them or exiting). Older
        checkpoints beyond `max_to_keep` are deleted once this one is complete.

        **Arguments:**

        - `step`: the checkpoint's step number (>= 0, not already saved).
        - `state`: the train state (`eqxpar.train.TrainState`, or any pytree).
          Only its arrays are saved; PRNG keys are saved as their raw key data.
        - `data_state`: a JSON-serialisable dict, e.g. `iterator.get_state()`.

        **Raises:** `CheckpointError` for a bad step, a step already saved, a
        state without arrays or a `data_state` JSON cannot hold; and, with
        `on_save_error="raise"`, when this save, or the previous one in the
        background, fails (with `"warn"`, a failed save is logged instead, once
        a save of this manager has completed).

        ```python
        manager.save(int(state.step), state, data_state=iterator.get_state())
        ```
        """
        if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"CheckpointManager.save(step={step!r}): expected an integer >= 0.")
        step = int(step)
        if step in self._step_dirs():
            complete = "" if step in self.all_steps() else " (as an incomplete checkpoint)"
            raise CheckpointError(
                f"checkpoint step {step} already exists in {str(self._directory)!r}{complete}. Save "
                f"each step once: use a new step number, or delete {str(self._directory / str(step))!r} "
                "first."
            )
        if data_state is not None and not isinstance(data_state, dict):
            raise CheckpointError(
                f"CheckpointManager.save(data_state={data_state!r}): expected a dict or None, "
                "e.g. ShardedIterator.get_state()."
            )
        try:
            data_json = json.loads(json.dumps(data_state, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"CheckpointManager.save(data_state={data_state!r}): not JSON-serialisable ({e}). "
                "Pass a dict of numbers and strings, e.g. ShardedIterator.get_state()."
            ) from e
        # Stacks a plan stores in a pipeline's order are written in natural order
        # (the order they record says how), so the files are the same under every
        # plan and restore into any other.
        leaves = _array_leaves(in_natural_order(state))
        if not leaves:
            raise CheckpointError(
                "CheckpointManager.save: the state has no array leaves to save; pass the "
                "train state (eqxpar.train.TrainState)."
            )
        arrays = {}
        records = []
        for i, (path, leaf) in enumerate(leaves):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise CheckpointError(
                    f"CheckpointManager.save: leaf {path} is an abstract ShapeDtypeStruct, not an "
                    "array. Save a concrete state (the one the train step returns)."
                )
            record = {"path": path, "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            if _is_key(leaf):
                record["key_impl"] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            record["data_shape"] = list(leaf.shape)
            arrays[_name(i)] = leaf
            records.append(record)
        meta = {"format": _FORMAT, "version": _VERSION, "leaves": records, "data_state": data_json}
        ocp = self._ocp
        args = ocp.args.Composite(**{_ARRAYS: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta)})
        # The previous save's background failure, if any, is its own step's to report.
        self.wait()
        try:
            _guard(
                lambda: self._manager.save(step, args=args, force=True),
                f"saving checkpoint step {step} to {str(self._directory)!r}",
                _WRITE_FIX.format(directory=str(self._directory)),
            )
        except CheckpointError as e:
            self._failed(step, e)
            return
        self._pending = step

    def wait(self) -> None:
        """Block until every started save is written and visible.

        **Raises:** `CheckpointError` if a background save failed (with
        `on_save_error="warn"`, once a save has completed, the failure is logged
        instead).

        ```python
        manager.save(step, state)
        manager.wait()               # the files of `step` are now complete
        ```
        """
        step, self._pending = self._pending, None
        try:
            _guard(
                self._manager.wait_until_finished,
                f"writing checkpoint step {step} to {str(self._directory)!r}",
                _WRITE_FIX.format(directory=str(self._directory)),
            )
        except CheckpointError as e:
            self._failed(step, e)
            return
        self._saved_once = self._saved_once or step is not None

    def _failed(self, step: int | None, error: CheckpointError) -> None:
        """A save of `step` failed: raise, or log it and go on (`on_save_error`)."""
        if self._on_save_error == "raise" or not self._saved_once:
            raise error
        try:
            latest = self.latest_step()
        except Exception:  # a directory that cannot even be listed must not stop training either
            latest = "unknown"
        get_logger(_LOGGER).warning(
            "checkpoint step %s was not saved; training goes on, and restore() loads the latest "
            "complete checkpoint (now step %s). %s",
            step,
            latest,
            error,
        )

    def restore(
        self,
        step: int | None = None,
        *,
        like: PyTree,
        plan: Plan | None = None,
        stored_order: str | Plan | None = None,
    ) -> tuple[PyTree, dict[str, Any] | None]:
        """Load checkpoint `step` (default: the latest) into the shape of `like`.

        Each array is read directly into the sharding `plan` gives it (for a
        `TrainState`, its `eqxpar.internal.StepLayout`), reading only this process's
        shards, so a state saved under one mesh and plan loads under any other
        (e.g. saved under `fsdp=8`, restored under `fsdp=4, tensor=2`).

        **Arguments:**

        - `step`: the checkpoint to load; None for the latest complete one.
        - `like`: a state of the same structure: the freshly initialised state, or
          its outline `eqx.filter_eval_shape(eqxpar.train.init, model, optim,
          plan, key=key)`. Its non-array parts are used as they are.
        - `plan`: the target plan; None to use the shardings of `like`'s arrays.
        - `stored_order`: only for a checkpoint of format version 1, which does
          not record the order its layer stacks (`eqxpar.nn.Stacked`) are in:
          eqxpar 0.1.0 wrote a stack as the model held it, so a model reordered by
          hand for an interleaved or uneven pipeline (`to_pipeline_order`) was
          saved in that pipeline's order; later version-1 files hold natural
          order. `"plan"`: the file holds each stack in the order the target
          (`plan`, else `like`) stores it in; an `eqxpar.Plan`: in the order that
          plan stores it in (the plan the file was saved under, to restore it
          under another); `"natural"`: in natural order. None (default): natural
          order, and a version-1 file whose target stores a stack in any other
          order is refused, since it may hold either. Version 2 (what `save`
          writes) always holds natural order, so it refuses `stored_order`.

        **Returns:** `(state, data_state)`: the restored state (global arrays, in
        the plan's shardings, each stack in the plan's order) and the saved
        `data_state` (None if none was saved).

        **Raises:** `CheckpointError` when there is no complete checkpoint, the
        step is missing or incomplete, the files are corrupt, truncated or of an
        unknown version, its arrays do not match `like`, a version-1 file's
        stack order is needed and not given, or `stored_order` is not one of the
        above (or is given for a version-2 file).

        ```python
        abstract = eqx.filter_eval_shape(eqxpar.train.init, model, optim, plan, key=key)
        state, data_state = manager.restore(like=abstract, plan=plan)
        iterator.set_state(data_state)
        # A version-1 file saved under this interleaved plan, its stack reordered
        # by hand, restored once and saved again as version 2:
        state, data_state = manager.restore(like=abstract, plan=plan, stored_order="plan")
        with eqxpar.checkpoint.CheckpointManager("ckpt-v2") as v2:
            v2.save(int(state.step), state, data_state=data_state)
        ```
        """
        _check_stored_order(stored_order)
        if plan is not None and not isinstance(plan, Plan):
            raise CheckpointError(
                f"CheckpointManager.restore(plan={plan!r}): expected an eqxpar.Plan or None."
            )
        self.wait()  # a save still being written would otherwise be invisible
        steps = self.all_steps()
        step = self._complete_step(step, steps)
        where = self._directory / str(step)
        fix = (
            f"delete {str(where)!r} and restore an earlier step "
            f"(restore(step=...), steps {[s for s in steps if s != step]}), or point the manager at "
            "the right directory."
        )
        meta = self._read_meta(step, where, fix)
        # Files hold every stack in natural order (see `save`); the target is
        # `like` with its stacks in the order the plan stores them in.
        target_like = like if plan is None else in_plan_order(_outline(like), plan)
        # The state as the file holds it: every stack in the order it was saved in.
        file_like = _as_saved(meta, where, stored_order, target_like)
        leaves = _array_leaves(file_like)
        records = meta["leaves"]
        legacy = _predates_skipped_steps(like, records, leaves)
        _check_matches(records, leaves[:-1] if legacy else leaves, where)
        resolved = None if plan is None else ResolvedPlan.of(plan)
        shardings = _target_shardings(target_like, resolved, _array_leaves(target_like))
        # A stack saved in another order than the target's is read with its layer
        # axis whole, then stored in the target's order.
        moved = [a != b for a, b in zip(_leaf_orders(file_like), _leaf_orders(target_like), strict=True)]
        reading = [_whole_layers(s) if m else s for s, m in zip(shardings, moved, strict=True)]
        target = _restore_target(records, reading[: len(records)])
        ocp = self._ocp
        arrays = _guard(
            lambda: self._manager.restore(
                step, args=ocp.args.Composite(**{_ARRAYS: ocp.args.StandardRestore(target)})
            )[_ARRAYS],
            f"reading the arrays of checkpoint {str(where)!r}",
            fix,
        )
        if legacy:
            # Saved before TrainState counted skipped steps: none were skipped.
            # Placed from host data, which any process may do for a replicated value.
            records = [*records, {"path": leaves[-1][0]}]
            arrays = {
                **arrays,
                _name(len(records) - 1): jax.device_put(np.zeros((), np.int32), shardings[-1]),
            }
        if any(moved):
            restored = _stored_as(_rebuild(file_like, records, arrays), target_like, shardings)
        else:
            restored = _rebuild(target_like, records, arrays)
        return restored, meta.get("data_state")

    def _complete_step(self, step: int | None, steps: list[int]) -> int:
        """`step`, checked to be a complete checkpoint; None gives the latest."""
        if step is None:
            if not steps:
                raise CheckpointError(
                    f"no complete checkpoint in {str(self._directory)!r}. Check the path, or "
                    "start from a fresh state when latest_step() is None."
                )
            step = steps[-1]
        if not isinstance(step, int | np.integer) or isinstance(step, bool) or step not in steps:
            state = "is incomplete in" if step in self._step_dirs() else "is not in"
            raise CheckpointError(
                f"checkpoint step {step!r} {state} {str(self._directory)!r} (complete steps: "
                f"{steps}). Restore one of those, or step=None for the latest."
            )
        return int(step)

    def _read_meta(self, step: int, where: pathlib.Path, fix: str) -> dict[str, Any]:
        """The metadata checkpoint `step` was saved with, checked to be this format and version."""
        ocp = self._ocp
        meta = _guard(
            lambda: self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[
                _META
            ],
            f"reading checkpoint {str(where)!r}",
            fix,
        )
        if (
            not isinstance(meta, dict)
            or meta.get("format") != _FORMAT
            or not isinstance(meta.get("leaves"), list)
        ):
            raise CheckpointError(f"{str(where)!r} is not an eqxpar checkpoint (unknown metadata): {fix}")
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in _READABLE:
            raise CheckpointError(
                f"{str(where)!r} has eqxpar checkpoint version {version!r}; this eqxpar "
                f"reads versions {', '.join(map(str, _READABLE))}. Restore it with the eqxpar version "
                "that wrote it."
            )
        return meta

    def close(self) -> None:
        """Wait for pending saves, then release the manager's threads (also on `with` exit).

        ```python
        with eqxpar.checkpoint.CheckpointManager("ckpt") as manager:
            manager.save(0, state)
        ```
        """
        if getattr(self, "_closed", False):  # closing twice is harmless
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self._directory)!r}, steps={self.all_steps()})"


_WRITE_FIX = (
    "make {directory!r} writable (permissions, a read-only mount, free disk space), or give "
    "CheckpointManager a directory this process can write."
)


def _check_retention(max_to_keep: int | None, keep_every: int | None) -> None:
    for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CheckpointError(f"CheckpointManager({name}={value!r}): expected an integer >= 1 or None.")
    if keep_every is not None and max_to_keep is None:
        raise CheckpointError(
            f"CheckpointManager(keep_every={keep_every}, max_to_keep=None): with max_to_keep=None "
            "every checkpoint is kept already. Give max_to_keep (the newest to keep) with "
            "keep_every, or drop keep_every."
        )


def _is_complete(step_dir: pathlib.Path) -> bool:
    """Whether `step_dir` holds both non-empty parts of an eqxpar checkpoint.

    orbax makes a step's directory visible only once it is written (by renaming a
    temporary one), so this separates real checkpoints from directories made by
    hand, copied halfway, or written by another tool, without reading any file.
    """
    parts = (step_dir / _ARRAYS, step_dir / _META)
    return all(part.is_dir() and any(part.iterdir()) for part in parts)


class _KeepLatest:
    """orbax preservation policy: keep the newest `n` complete checkpoints, and every
    one whose step is a multiple of `every` (when given).

    Incomplete step directories are neither counted nor deleted (they may be a
    copy still under way; deleting them is the user's call). orbax asks when a
    save starts, so the step being saved, which has no directory yet, counts.
    """

    def __init__(self, directory: pathlib.Path, n: int, every: int | None = None):
        self.directory = directory
        self.n = n
        self.every = every

    def _counts(self, step: int) -> bool:
        path = self.directory / str(step)
        return not path.exists() or _is_complete(path)

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        counted = [self._counts(info.step) for info in checkpoints]
        kept = sorted(info.step for info, ok in zip(checkpoints, counted, strict=True) if ok)[-self.n :]
        return [
            not ok or info.step in kept or (self.every is not None and info.step % self.every == 0)
            for info, ok in zip(checkpoints, counted, strict=True)
        ]


def _guard(fn: Callable[[], Any], doing: str, fix: str) -> Any:
    # orbax and tensorstore report a damaged file as a deep traceback of their own
    # exception types; turn any failure into one eqxpar error that says what was
    # being done, where, and what to do about it.
    try:
        return fn()
    except EqxparError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        error = CheckpointError(f"{doing} failed: {type(e).__name__}: {first[:500]}. Fix: {fix}")
        # The library's own traceback stays reachable as __context__ but is not printed.
        raise error from None


def _check_matches(records: list[dict[str, Any]], leaves: list[tuple[str, Any]], where: pathlib.Path) -> None:
    fix = (
        "Restore with `like` built for the same model and optimizer as the saved run "
        "(e.g. eqx.filter_eval_shape(eqxpar.train.init, model, optimizer, plan, key=key))."
    )
    if len(records) != len(leaves):
        raise CheckpointError(
            f"{str(where)!r} holds {len(records)} arrays but `like` has {len(leaves)}. {fix}"
        )
    for record, (path, leaf) in zip(records, leaves, strict=True):
        saved = (record.get("path"), tuple(record.get("shape", ())), record.get("dtype"))
        wanted = (path, tuple(leaf.shape), str(leaf.dtype))
        if saved != wanted:
            raise CheckpointError(
                f"{str(where)!r} does not match `like`: saved leaf {saved[0]} has shape {saved[1]} "
                f"and dtype {saved[2]}, but `like` has {wanted[0]} with shape {wanted[1]} and dtype "
                f"{wanted[2]}. {fix}"
            )


def _predates_skipped_steps(
    like: PyTree, records: list[dict[str, Any]], leaves: list[tuple[str, Any]]
) -> bool:
    """Whether the checkpoint holds a `TrainState` saved before it had
    `skipped_steps` (its last field, so its last array leaf): every array of
    `like` but that one."""
    if not isinstance(like, TrainState) or len(records) != len(leaves) - 1 or not leaves:
        return False
    path = leaves[-1][0]
    return path == ".skipped_steps" and all(r.get("path") != path for r in records)


def _restore_target(records: list[dict[str, Any]], shardings: list[Sharding]) -> dict[str, Any]:
    """What orbax reads each saved array into: its shape and dtype, in its target sharding
    (a PRNG key is read as its raw uint32 data)."""
    target = {}
    for i, (record, sharding) in enumerate(zip(records, shardings, strict=True)):
        dtype = jnp.uint32 if "key_impl" in record else jnp.dtype(record["dtype"])
        target[_name(i)] = jax.ShapeDtypeStruct(tuple(record["data_shape"]), dtype, sharding=sharding)
    return target


def _rebuild(like: PyTree, records: list[dict[str, Any]], arrays: dict[str, Any]) -> PyTree:
    """`like` with its arrays replaced by the restored ones (PRNG keys re-wrapped)."""
    restored = []
    for i, record in enumerate(records):
        value = arrays[_name(i)]
        if "key_impl" in record:
            value = jax.random.wrap_key_data(value, impl=record["key_impl"])
        restored.append(value)
    flat, treedef = jax.tree.flatten(like)
    it = iter(restored)
    return jax.tree.unflatten(treedef, [next(it) if _is_array(leaf) else leaf for leaf in flat])


def _outline(tree: PyTree) -> PyTree:
    """`tree` with its arrays as `jax.ShapeDtypeStruct`s (shardings kept), so that
    reordering its stacks moves no data."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
            if _is_array(x)
            else x
        ),
        tree,
    )


def _leaf_orders(tree: PyTree) -> list[Any]:
    """For every array leaf of `tree`: the order of the stack it is part of (a
    `StackOrder`; None for natural order or no stack)."""
    flat = jax.tree.leaves(tree)
    orders: list[Any] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_stack):
        order = node.order if _is_stack(node) else None
        orders.extend([order] * len(jax.tree.leaves(node)))
    return [o for x, o in zip(flat, orders, strict=True) if _is_array(x)]


def _check_stored_order(stored_order: Any) -> None:
    if stored_order is None or isinstance(stored_order, Plan):
        return
    if not isinstance(stored_order, str) or stored_order not in _STORED_ORDERS:
        raise CheckpointError(
            f"CheckpointManager.restore(stored_order={stored_order!r}): expected 'natural', 'plan', "
            "an eqxpar.Plan or None: the order a version-1 checkpoint holds its layer stacks in "
            "('plan': the order the target plan stores them in; a Plan: the order that plan stores "
            "them in, e.g. the plan the file was saved under)."
        )


def _as_saved(meta: dict[str, Any], where: pathlib.Path, stored_order: Any, target_like: PyTree) -> PyTree:
    """The outline of the state as checkpoint `where` holds it: `target_like` with
    every stack in the order the file holds it in (`restore`'s `stored_order`)."""
    version = meta["version"]
    natural_like = in_natural_order(_outline(target_like))
    if version != 1:
        if stored_order is not None:
            raise CheckpointError(
                f"{str(where)!r} is an eqxpar checkpoint of version {version}, which holds every layer "
                f"stack in natural order whatever plan saved it, so stored_order={stored_order!r} has "
                "nothing to say: it is for version-1 files, which do not record their order. Drop "
                "stored_order."
            )
        return natural_like
    if stored_order is None:
        _check_v1_order_known(where, target_like)
        return natural_like
    if stored_order == "natural":
        return natural_like
    if stored_order == "plan":
        return target_like
    return in_plan_order(natural_like, stored_order)


def _check_v1_order_known(where: pathlib.Path, target_like: PyTree) -> None:
    """Refuse a version-1 file (no recorded order) for a target that stores a stack
    in a pipeline's order: read as natural order, a file saved in that order (by
    eqxpar 0.1.0) would be permuted a second time, silently."""
    flat = jax.tree_util.tree_flatten_with_path(target_like, is_leaf=_is_stack)[0]
    stored = [(jax.tree_util.keystr(p), n.order) for p, n in flat if _is_stack(n) and n.order is not None]
    if not stored:
        return
    path, order = stored[0]
    others = f" (and {len(stored) - 1} more stacks)" if len(stored) > 1 else ""
    raise CheckpointError(
        f"{str(where)!r} is an eqxpar checkpoint of version 1, which does not record the order of "
        f"its layer stacks, and the restore target stores {path}{others} in {describe_order(order)}. "
        "A version-1 file may hold either order: eqxpar 0.1.0 saved a stack as the model held it (a "
        "pipeline's order, for a model reordered by hand with eqxpar.pipeline.to_pipeline_order), "
        "later version-1 files natural order; read as the wrong one, the layers would be permuted "
        "silently. Fix: pass restore(..., stored_order=...) saying which order the file holds: "
        "stored_order='plan' if it was saved under this plan (its stacks in this plan's order), the "
        "eqxpar.Plan it was saved under if another, 'natural' if natural order; then save it again "
        "with this eqxpar (version 2, which holds natural order and restores under any plan)."
    )


def _whole_layers(sharding: Sharding) -> Sharding:
    """`sharding` with the leading (layer) dimension kept whole: a stack is read in
    natural order, then stored in the plan's order."""
    if not isinstance(sharding, NamedSharding):
        raise CheckpointError(
            f"CheckpointManager.restore: a stack stored in a pipeline's layer order needs a "
            f"NamedSharding to restore into, got {sharding}. Pass plan=... (the target plan)."
        )
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, PartitionSpec(None, *spec[1:]))


def _is_stack(node: Any) -> bool:
    return isinstance(node, Stacked)


@eqx.filter_jit
def _stored_as_jit(restored: PyTree, orders: tuple, shardings: tuple[Sharding, ...]) -> PyTree:
    it = iter(orders)
    moved = jax.tree.map(lambda n: n.stored_in(next(it)) if _is_stack(n) else n, restored, is_leaf=_is_stack)
    flat, treedef = jax.tree.flatten(moved)
    placed = iter(shardings)
    flat = [jax.lax.with_sharding_constraint(x, next(placed)) if _is_array(x) else x for x in flat]
    return jax.tree.unflatten(treedef, flat)


def _stored_as(restored: PyTree, target_like: PyTree, shardings: list[Sharding]) -> PyTree:
    """`restored` (natural order) with every stack in `target_like`'s order, each
    array in its target sharding."""
    orders = tuple(n.order for n in jax.tree.leaves(target_like, is_leaf=_is_stack) if _is_stack(n))
    return _stored_as_jit(restored, orders, tuple(shardings))


def _target_shardings(
    like: PyTree, resolved: ResolvedPlan | None, leaves: list[tuple[str, Any]]
) -> list[Sharding]:
    """The sharding each array leaf of `like` is restored into: under the target
    plan (`resolved`), or, without one, the leaf's own."""
    if resolved is not None:
        _, treedef = jax.tree.flatten(like)
        # In host memory where the plan offloads (Plan(offload=...)): read there directly.
        shardings = [s for s in treedef.flatten_up_to(state_shardings(like, resolved)) if s is not None]
        if len(shardings) != len(leaves):
            raise CheckpointError(
                "CheckpointManager.restore: the plan's rules did not give every array leaf of `like` "
                "a sharding; pass a `like` whose array leaves are arrays or jax.ShapeDtypeStructs."
            )
        return shardings
    out = []
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, Sharding):
            raise CheckpointError(
                f"CheckpointManager.restore(plan=None): leaf {path} of `like` has no sharding to "
                "restore into. Pass plan=... (the target plan), or a `like` of placed arrays."
            )
        out.append(sharding)
    return out
