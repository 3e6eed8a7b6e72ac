"""Global batches from per-process rows, and a deterministic, resumable iterator.

In a multi-process run each process holds only some devices, so each feeds only
the rows of the global batch that land on its devices. `process_slice` says which
rows those are, `global_batch` assembles the processes' rows into one global
array, and `ShardedIterator` picks the rows of each step's global batch from an
in-memory dataset or a `TokenFile` on disk, so that the global batch at step `t`
is the same whatever the number of processes: a run on 2 processes x 4 devices
sees the same data as one on 1 process x 8 devices.
"""

import json
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import ArrayLike, PyTree

from .._batch_layout import BatchLayout
from .._errors import BatchError, PlanError
from .._plan import Plan
from .._specs import is_array_like
from ._packed_tokens import PackedTokens
from ._token_file import TokenFile

# Datasets on disk that read only the rows asked for (`len`, `read(indices)`).
_ON_DISK = (TokenFile, PackedTokens)


def _local_blocks(layout: BatchLayout) -> list[int]:
    # The batch is cut into `layout.blocks` equal blocks, one per position
    # along the batch axes; these are the blocks this process's devices hold.
    blocks = layout.blocks
    index_map = layout.sharding.addressable_devices_indices_map((blocks,))
    return sorted({index[0].indices(blocks)[0] for index in index_map.values()})


def process_slice(global_batch_size: int, plan: Plan) -> slice:
    """The rows of a global batch that this process feeds to its devices.

    The rows are contiguous for every mesh `eqxpar.make_mesh` builds (its batch
    axes are outermost, and JAX orders devices process by process). With one
    process this is `slice(0, global_batch_size)`.

    **Arguments:**

    - `global_batch_size`: rows in the global batch; a multiple of
      `plan.batch_size_multiple`.
    - `plan`: the plan whose `batch_spec` splits the batch.

    **Returns:** a `slice` into the global batch's leading dimension.

    **Raises:** `BatchError` when the size does not split over the batch axes, or
    when this process's rows are not contiguous (a hand-built mesh that
    interleaves processes along the batch axes).

    ```python
    rows = eqxpar.data.process_slice(64, plan)     # slice(0, 32) on process 0 of 2
    batch = eqxpar.data.global_batch((x[rows], y[rows]), plan)
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"process_slice(..., plan={plan!r}): expected an eqxpar.Plan.")
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise BatchError(f"process_slice(global_batch_size={global_batch_size!r}): expected an integer >= 1.")
    layout = BatchLayout.of(plan)
    blocks = layout.blocks
    if global_batch_size % blocks:
        raise BatchError(
            f"global batch size {global_batch_size} is not divisible by the {blocks} "
            f"data-parallel devices (mesh axes {layout.axes}). Use a multiple of {blocks}."
        )
    mine = _local_blocks(layout)
    if mine != list(range(mine[0], mine[0] + len(mine))):
        raise BatchError(
            f"process {jax.process_index()} holds batch blocks {mine} of {blocks}, which are "
            "not contiguous, so its rows are not one slice. Build the mesh with "
            "eqxpar.make_mesh (batch axes outermost, devices in process order)."
        )
    rows = global_batch_size // blocks
    return slice(mine[0] * rows, (mine[-1] + 1) * rows)


def global_batch(local: PyTree[ArrayLike], plan: Plan) -> PyTree[jax.Array]:
    """Assemble each process's rows into global arrays split by `plan.batch_spec`.

    Every process calls it with its own rows (those `process_slice` names, in
    order), the same pytree structure and the same trailing shapes; the result
    is the global batch, ready for a train step. With one process it equals
    `eqxpar.shard_batch(local, plan)`.

    **Arguments:**

    - `local`: a pytree of arrays (numpy or JAX) whose leaves share the leading
      (row) dimension: this process's rows.
    - `plan`: the plan whose `batch_spec` splits the batch.

    **Returns:** the same pytree of global `jax.Array`s, each with
    `local rows x (number of batch blocks / blocks on this process)` rows.

    **Raises:** `BatchError` when a leaf is a scalar, the leaves' row counts
    differ, or the row count does not split over this process's devices.

    ```python
    rows = eqxpar.data.process_slice(64, plan)
    batch = eqxpar.data.global_batch({"x": x[rows], "y": y[rows]}, plan)
    state, metrics = step(state, batch)
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"global_batch(..., plan={plan!r}): expected an eqxpar.Plan.")
    leaves, treedef = jax.tree.flatten(local)
    sizes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(local)[0]:
        where = jax.tree_util.keystr(path) or "<root>"
        if not is_array_like(leaf):
            raise BatchError(
                f"global_batch: leaf {where} is {type(leaf).__name__}, not an array. Pass a "
                "pytree of numpy or JAX arrays with a leading row dimension."
            )
        if len(leaf.shape) == 0:
            raise BatchError(
                f"global_batch: leaf {where} is a scalar; every batch leaf needs a leading row dimension."
            )
        sizes.add(leaf.shape[0])
    if not leaves:
        raise BatchError(
            "global_batch: the batch has no array leaves; pass arrays with a leading row dimension."
        )
    if len(sizes) > 1:
        raise BatchError(
            f"global_batch: the leaves have different row counts {sorted(sizes)}; every leaf "
            "of a batch must have the same number of rows."
        )
    (rows,) = sizes
    layout = BatchLayout.of(plan)
    mine = len(_local_blocks(layout))
    if rows == 0 or rows % mine:
        raise BatchError(
            f"global_batch: this process has {rows} rows, but its devices hold {mine} of the "
            f"{layout.blocks} batch blocks (mesh axes {layout.axes}), so it needs a "
            f"positive multiple of {mine} rows. Take the rows from "
            "eqxpar.data.process_slice(global_batch_size, plan)."
        )
    total = rows // mine * layout.blocks
    out = [
        jax.make_array_from_process_local_data(layout.sharding, np.asarray(leaf), (total, *leaf.shape[1:]))
        for leaf in leaves
    ]
    return jax.tree.unflatten(treedef, out)


def check_int(value: Any, name: str, low: int, where: str = "ShardedIterator") -> int:
    """`value` as an int, or a `BatchError` naming it when it is not an integer >= `low`."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise BatchError(f"{where}: {name}={value!r} is not valid; expected an integer >= {low}.")
    return int(value)


class EpochOrder:
    """The order of a dataset's examples in each epoch: a permutation seeded by
    `(seed, epoch)` alone, or the dataset order. Shared by `ShardedIterator` and
    the grain sampler (`_grain.py`), so that both give the same batches.

    The last epoch's order is kept: a step needs one slice of it, and computing a
    permutation of millions of sequences every step would cost more than reading
    the batch.
    """

    def __init__(self, examples: int, *, seed: int, shuffle: bool):
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self._epoch: int | None = None
        self._order = np.zeros((0,), np.int64)

    def __call__(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.examples)
            else:
                order = np.arange(self.examples)
            order.setflags(write=False)
            self._epoch, self._order = epoch, order
        return self._order

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """Indices of step `step`'s global batch of `batch_size` (last partial batch dropped)."""
        epoch, position = divmod(step, self.examples // batch_size)
        return self(epoch)[position * batch_size : (position + 1) * batch_size]


def _dataset_size(data: Any) -> int:
    if isinstance(data, _ON_DISK):
        return len(data)
    sizes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(data)[0]:
        where = jax.tree_util.keystr(path) or "<root>"
        if not is_array_like(leaf) or len(leaf.shape) == 0:
            raise BatchError(
                f"ShardedIterator: dataset leaf {where} is not an array with a leading "
                "example dimension. Pass a pytree of arrays of shape (examples, ...), an "
                "eqxpar.data.TokenFile or an eqxpar.data.PackedTokens."
            )
        sizes.add(leaf.shape[0])
    if not sizes:
        raise BatchError("ShardedIterator: the dataset has no array leaves.")
    if len(sizes) > 1:
        raise BatchError(
            f"ShardedIterator: the dataset's leaves have different example counts "
            f"{sorted(sizes)}; every leaf must have one row per example."
        )
    (size,) = sizes
    return size


class ShardedIterator:
    """This process's rows of each step's global batch, from memory or a file on disk.

    Step `t`'s global batch is the `batch_size` examples at positions
    `[i * batch_size, (i + 1) * batch_size)` of epoch `e`'s permutation of the
    dataset (`t = e * steps_per_epoch + i`; the permutation comes from `seed` and
    `e` only; a last partial batch of each epoch is dropped). Each process yields
    only its rows of it (`process_slice`), so the global batch does not depend on
    how many processes there are. The iterator runs forever, epoch after epoch.

    Its position is a small JSON-serialisable state `{"step": t, "seed": s}`:
    save `get_state()` with a checkpoint and `set_state(...)` on resume to
    continue with exactly the batches an uninterrupted run would have seen.

    With a `TokenFile` as its dataset the examples are the file's sequences, and
    each step reads from disk only this process's rows: an int32 array of shape
    `(rows, seq_len + 1)`, the batch `eqxpar.models.lm_loss` takes. With a
    `PackedTokens` the examples are its packed rows, and each step is a dict of
    `tokens`, `segment_ids`, `positions` and `weights`, each `(rows, seq_len + 1)`.

    **Arguments:**

    - `data`: a pytree of arrays sharing their leading (example) dimension (every
      process holds the same dataset), an `eqxpar.data.TokenFile` (every
      process maps the same file) or an `eqxpar.data.PackedTokens` (every process
      packs the same documents the same way).
    - `plan`: the plan whose `batch_spec` splits the batch.
    - `batch_size`: rows in the global batch (a multiple of
      `plan.batch_size_multiple`, at most the dataset size).
    - `seed`: seeds the per-epoch permutations.
    - `shuffle`: permute each epoch (False: dataset order every epoch).
    - `step`: the step to start at (as in a saved state).

    ```python
    it = eqxpar.data.ShardedIterator((x, y), plan, batch_size=64, seed=0)
    for _ in range(steps):
        state, metrics = train_step(state, eqxpar.data.global_batch(next(it), plan))
    saved = it.get_state()                        # {"step": steps, "seed": 0}
    tokens = eqxpar.data.ShardedIterator(eqxpar.data.TokenFile("train.bin", seq_len=1024,
                                         dtype=np.uint16), plan, batch_size=64, seed=0)
    ```
    """

    def __init__(
        self,
        data: PyTree[ArrayLike] | TokenFile | PackedTokens,
        plan: Plan,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        step: int = 0,
    ):
        if not isinstance(plan, Plan):
            raise PlanError(f"ShardedIterator(..., plan={plan!r}): expected an eqxpar.Plan.")
        self._examples = _dataset_size(data)
        self._batch_size = check_int(batch_size, "batch_size", 1)
        if self._batch_size > self._examples:
            raise BatchError(
                f"ShardedIterator: batch_size={batch_size} is larger than the dataset "
                f"({self._examples} examples). Use a batch size of at most {self._examples}."
            )
        self._rows = process_slice(self._batch_size, plan)
        # Arrays are held as numpy once, so each step only gathers rows; a token
        # file stays on disk and each step reads its rows.
        self._data = data if isinstance(data, _ON_DISK) else jax.tree.map(np.asarray, data)
        self._order = EpochOrder(self._examples, seed=check_int(seed, "seed", 0), shuffle=bool(shuffle))
        self._step = check_int(step, "step", 0)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the dataset."""
        return self._examples // self._batch_size

    @property
    def rows(self) -> slice:
        """This process's rows of each global batch (`process_slice(batch_size, plan)`)."""
        return self._rows

    @property
    def step(self) -> int:
        """The step whose batch `next()` returns."""
        return self._step

    def global_indices(self, step: int) -> np.ndarray:
        """Dataset indices of step `step`'s whole global batch, in batch order.

        The rows `next()` yields for that step are
        `global_indices(step)[it.rows]`. For a dataset in a format of your own:
        load only those examples yourself.

        ```python
        mine = it.global_indices(it.step)[it.rows]
        ```
        """
        return self._order.batch(check_int(step, "step", 0), self._batch_size)

    def __iter__(self) -> Iterator[PyTree[np.ndarray]]:
        return self

    def __next__(self) -> PyTree[np.ndarray]:
        indices = self.global_indices(self._step)[self._rows]
        self._step += 1
        if isinstance(self._data, _ON_DISK):
            return self._data.read(indices)
        return jax.tree.map(lambda leaf: leaf[indices], self._data)

    def get_state(self) -> dict[str, int]:
        """The position, `{"step": ..., "seed": ...}`: JSON-serialisable, tiny.

        ```python
        manager.save(step, state, data_state=it.get_state())
        ```
        """
        return {"step": self._step, "seed": self._order.seed}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a state `get_state()` returned (in this or another run).

        **Raises:** `BatchError` when `state` is not such a dict.

        ```python
        state, data_state = manager.restore(like=state, plan=plan)
        it.set_state(data_state)
        ```
        """
        if not isinstance(state, dict) or set(state) != {"step", "seed"}:
            raise BatchError(
                f"ShardedIterator.set_state({state!r}): expected a dict with exactly the keys "
                "'step' and 'seed', as returned by get_state()."
            )
        step = check_int(state["step"], "step", 0)
        seed = check_int(state["seed"], "seed", 0)
        if seed != self._order.seed:
            self._order = EpochOrder(self._examples, seed=seed, shuffle=self._order.shuffle)
        self._step = step

    def __repr__(self) -> str:
        return f"ShardedIterator({json.dumps(self.get_state())}, batch_size={self._batch_size}, rows={self._rows})"
