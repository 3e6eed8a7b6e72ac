"""grain, the JAX ecosystem's data loader, fed in eqxpar's order.

grain's own `IndexSampler` with `ShardOptions(process_index, process_count)`
gives each process a contiguous part of the dataset and shuffles within it, so
the global batch of a step changes with the number of processes. `GrainSampler`
instead hands grain's `DataLoader` the records `ShardedIterator` would: step
`t`'s global batch is the same slice of the same seeded permutation, and each
process (grain "shard") loads only its rows of it. grain is imported only when a
sampler's shard options or a loader are built (the optional extra `grain`).
"""

import sys
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import BatchError
from .._plan import Plan
from ._data import EpochOrder, check_int, process_slice


def _grain() -> ModuleType:
    try:
        import grain
    except ImportError:
        raise BatchError(
            "eqxpar's grain adapter needs the `grain` package, which is not installed. Install "
            "it with `pip install eqxpar[grain]` (or `pip install grain`)."
        ) from None
    return grain


class GrainSampler:
    """A grain sampler that yields `ShardedIterator`'s order, one process's rows at a time.

    grain's `DataLoader` asks a sampler for index `k * shard_count + shard_index`
    as this shard's `k`-th record, and with `W` worker processes hands worker `w`
    the records `k = w + W * j`, each worker batching its own and the loader
    taking their batches in turn. `GrainSampler` answers so that the loader,
    batching `local_batch_size` records (`grain.transforms.Batch`), yields this
    process's rows of each global batch of `batch_size`: step `t`'s global batch
    is the records `ShardedIterator(..., batch_size, seed, shuffle)` puts at step
    `t`, whatever `shard_count` is. Each record's `rng` is seeded by `seed` and
    its position in the global order, so random transforms too are independent of
    the process count.

    Build it from a plan with `eqxpar.data.grain_sampler`, or directly when the
    shards are your own (`shard_index` in `[0, shard_count)`, each holding
    `batch_size // shard_count` consecutive rows of each global batch).

    **Arguments:**

    - `num_records`: records in the data source (`len(source)`).
    - `batch_size`: rows in the global batch; a multiple of `shard_count`, at most
      `num_records`.
    - `shard_index`, `shard_count`: this shard and how many there are.
    - `seed`, `shuffle`: the per-epoch permutation, as `ShardedIterator`'s.
    - `step`: the global step the loader starts at: `ShardedIterator.get_state()
      ["step"]`, or the number of batches a run took before it was saved.
    - `num_epochs`: stop after this many epochs (counted from step 0); `None` runs
      forever.
    - `worker_count`: the `DataLoader`'s `worker_count`, which decides which
      records make up each batch.

    ```python
    sampler = eqxpar.data.GrainSampler(len(tokens), batch_size=64, shard_index=0,
                                       shard_count=2, seed=0)
    loader = grain.DataLoader(data_source=tokens, sampler=sampler,
                              shard_options=sampler.shard_options,
                              operations=[grain.transforms.Batch(sampler.local_batch_size)])
    ```
    """

    def __init__(
        self,
        num_records: int,
        *,
        batch_size: int,
        shard_index: int = 0,
        shard_count: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        step: int = 0,
        num_epochs: int | None = None,
        worker_count: int = 0,
    ):
        where = "GrainSampler"
        self._records = check_int(num_records, "num_records", 1, where)
        self._batch_size = check_int(batch_size, "batch_size", 1, where)
        self._count = check_int(shard_count, "shard_count", 1, where)
        self._index = check_int(shard_index, "shard_index", 0, where)
        if self._index >= self._count:
            raise BatchError(
                f"GrainSampler: shard_index={shard_index} is not below shard_count={shard_count}; "
                f"expected a shard in [0, {self._count})."
            )
        if self._batch_size % self._count:
            raise BatchError(
                f"GrainSampler: batch_size={batch_size} does not split over shard_count="
                f"{shard_count} shards. Use a multiple of {self._count}."
            )
        if self._batch_size > self._records:
            raise BatchError(
                f"GrainSampler: batch_size={batch_size} is larger than the data source "
                f"({self._records} records). Use a batch size of at most {self._records}."
            )
        self._order = EpochOrder(self._records, seed=check_int(seed, "seed", 0, where), shuffle=bool(shuffle))
        self._step = check_int(step, "step", 0, where)
        self._epochs = None if num_epochs is None else check_int(num_epochs, "num_epochs", 1, where)
        self._local = self._batch_size // self._count
        self._workers = check_int(worker_count, "worker_count", 0, where)

    @property
    def local_batch_size(self) -> int:
        """Rows of each global batch this shard loads: `batch_size // shard_count`."""
        return self._local

    @property
    def shard_options(self) -> Any:
        """`grain.sharding.ShardOptions` for this shard, to pass to grain's `DataLoader`."""
        return _grain().sharding.ShardOptions(
            shard_index=self._index, shard_count=self._count, drop_remainder=True
        )

    def _global_position(self, index: int) -> tuple[int, int]:
        # Index `index` is this shard's record k = index // shard_count; worker
        # w = k % W makes the j-th batch (j = k // W // local) of its records, which
        # the loader yields as batch j * W + w; its row is the shard's block plus
        # the record's place in that batch.
        k, shard = divmod(index, self._count)
        workers = max(self._workers, 1)
        j, worker = divmod(k, workers)
        batch, row = divmod(j, self._local)
        return self._step + batch * workers + worker, shard * self._local + row

    def __len__(self) -> int:
        if self._epochs is None:
            return sys.maxsize
        steps = self._epochs * (self._records // self._batch_size) - self._step
        return max(steps, 0) * self._batch_size

    def __getitem__(self, index: int) -> Any:
        """grain's `RecordMetadata` of index `index` (this shard's record `index // shard_count`)."""
        if not 0 <= index < len(self):
            raise IndexError(f"GrainSampler: index {index} is out of range [0, {len(self)}).")
        step, row = self._global_position(index)
        key = int(self._order.batch(step, self._batch_size)[row])
        position = step * self._batch_size + row
        rng = np.random.Generator(np.random.Philox(key=np.array([position, self._order.seed], np.uint64)))
        return _grain().RecordMetadata(index=index, record_key=key, rng=rng)

    def __repr__(self) -> str:
        # grain checks a restored iterator's sampler by this repr.
        epochs = "" if self._epochs is None else f", num_epochs={self._epochs}"
        return (
            f"GrainSampler(num_records={self._records}, batch_size={self._batch_size}, "
            f"shard_index={self._index}, shard_count={self._count}, seed={self._order.seed}, "
            f"shuffle={self._order.shuffle}, step={self._step}{epochs}, worker_count={self._workers})"
        )


def grain_sampler(
    num_records: int,
    plan: Plan,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    step: int = 0,
    num_epochs: int | None = None,
    worker_count: int = 0,
) -> GrainSampler:
    """This process's `GrainSampler`: its shard is its rows of the global batch.

    The shard is `process_slice(batch_size, plan)`, not the process index: a
    process whose devices hold a quarter of each global batch is one of 4
    shards, and processes that hold the same rows (the batch replicated across
    them, e.g. tensor parallel across processes) load the same shard.

    **Arguments:** `num_records` (`len(source)`), `plan` (whose `batch_spec`
    splits the batch), and the keywords of `GrainSampler`.

    **Returns:** a `GrainSampler`; pass it and its `shard_options` to
    `grain.DataLoader`, with `grain.transforms.Batch(sampler.local_batch_size)`.

    ```python
    sampler = eqxpar.data.grain_sampler(len(tokens), plan, batch_size=64, seed=0)
    ```
    """
    if not isinstance(plan, Plan):
        raise BatchError(f"grain_sampler(..., plan={plan!r}): expected an eqxpar.Plan.")
    rows = process_slice(check_int(batch_size, "batch_size", 1, "grain_sampler"), plan)
    local = rows.stop - rows.start
    return GrainSampler(
        num_records,
        batch_size=batch_size,
        shard_index=rows.start // local,
        shard_count=batch_size // local,
        seed=seed,
        shuffle=shuffle,
        step=step,
        num_epochs=num_epochs,
        worker_count=worker_count,
    )


def grain_loader(
    source: Any,
    plan: Plan,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    step: int = 0,
    num_epochs: int | None = None,
    operations: tuple | list = (),
    worker_count: int = 0,
) -> Any:
    """A `grain.DataLoader` yielding this process's rows of each global batch.

    The batches are those of `ShardedIterator(source, plan, batch_size=...,
    seed=..., shuffle=...)` (for a `TokenFile`, the same arrays), loaded by
    grain, optionally in `worker_count` worker processes. The position is the
    same `{"step": t, "seed": s}` as `ShardedIterator.get_state()`, independent
    of the process count: save the number of batches taken, and resume with
    `grain_loader(..., step=data_state["step"], seed=data_state["seed"])`.
    (grain's own iterator state is per process, and a checkpoint's `data_state`
    is one dict for all processes.)

    **Arguments:**

    - `source`: a grain `RandomAccessDataSource` (`len`, `source[i]`), such as an
      `eqxpar.data.TokenFile`.
    - `plan`, `batch_size`, `seed`, `shuffle`, `step`, `num_epochs`: as
      `grain_sampler`.
    - `operations`: grain transformations applied to each record before batching.
    - `worker_count`: grain worker processes (0: load in this process). grain
      reads an absl flag when it starts them, so outside an absl app the flags
      are marked parsed (keeping their defaults).

    **Returns:** a `grain.DataLoader`; iterating it gives this process's rows.

    **Raises:** `BatchError` when grain is not installed (`pip install
    eqxpar[grain]`) or the batch does not fit the source or the plan.

    ```python
    loader = iter(eqxpar.data.grain_loader(tokens, plan, batch_size=64, seed=0))
    state, metrics = train_step(state, eqxpar.data.global_batch(next(loader), plan))
    ```
    """
    grain = _grain()
    workers = check_int(worker_count, "worker_count", 0, "grain_loader")
    if workers:
        # grain (0.2.18) reads one of its absl flags when it starts workers,
        # which fails outside an absl app (flags never parsed); they keep their
        # defaults, as they would under absl.app.run with no flags given.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
    sampler = grain_sampler(
        len(source),
        plan,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        step=step,
        num_epochs=num_epochs,
        worker_count=workers,
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        shard_options=sampler.shard_options,
        operations=[
            *operations,
            grain.transforms.Batch(batch_size=sampler.local_batch_size, drop_remainder=True),
        ],
        worker_count=workers,
    )
