"""A file of token ids on disk, memory-mapped and read as fixed-length sequences.

A language model's training set is often one long array of token ids written
flat to disk: nanoGPT's `train.bin` (raw `uint16`), a raw `uint32` file for
vocabularies above 65,536, or a `.npy` file. `TokenFile` maps it (nothing is read
until a sequence is asked for) and cuts it into sequences of `seq_len + 1`
tokens, the `(batch, seq + 1)` rows `eqxpar.models.lm_loss` takes, so each process
reads only the sequences of its own rows.
"""

import mmap
import operator
import os
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np
from jaxtyping import Int

from .._errors import BatchError

# Read as int32, the ids `lm_loss` and the embedding take.
_OUT = np.dtype(np.int32)
_INT32_MAX = np.iinfo(np.int32).max


def _check_seq_len(seq_len: Any) -> int:
    if not isinstance(seq_len, int | np.integer) or isinstance(seq_len, bool) or seq_len < 1:
        raise BatchError(
            f"TokenFile(seq_len={seq_len!r}): expected an integer >= 1 (each sequence is "
            "seq_len + 1 tokens: seq_len inputs and their next-token targets)."
        )
    return int(seq_len)


def _check_dtype(dtype: Any, path: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise BatchError(f"TokenFile({path!r}, dtype={dtype!r}): not a numpy dtype ({e}).") from None
    if dt.kind not in "iu" or dt.itemsize > 8:
        raise BatchError(
            f"TokenFile({path!r}, dtype={dtype!r}): token ids are integers; pass dtype=np.uint16 "
            "(nanoGPT's train.bin) or np.uint32 for vocabularies above 65,536."
        )
    return dt


# madvise is missing on Windows; there the mapping takes the OS's defaults.
_ADVISE = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_RANDOM") and hasattr(mmap, "MADV_DONTNEED")


def _npy_layout(path: str, dtype: Any) -> tuple[np.dtype, int, int]:
    """The ids' dtype, the byte offset of the first and their count, from a .npy header."""
    fix = "Save the token ids as one flat integer array: np.save(path, ids.astype(np.uint16))."
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dt = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dt = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version} is not 1.0 or 2.0")
        except ValueError as e:
            raise BatchError(f"TokenFile({path!r}): not a .npy file eqxpar can map ({e}). {fix}") from None
        offset = f.tell()
    if len(shape) != 1 or dt.kind not in "iu":
        raise BatchError(
            f"TokenFile({path!r}): the .npy file holds a {dt} array of shape {shape}; expected one "
            f"flat integer array of token ids. {fix}"
        )
    if dtype is not None and _check_dtype(dtype, path) != dt:
        raise BatchError(
            f"TokenFile({path!r}, dtype={np.dtype(dtype)}): the .npy file says its ids are {dt}. "
            f"Leave dtype out for a .npy file (its header has it) or pass dtype=np.{dt}."
        )
    size = os.path.getsize(path)
    if size < offset + shape[0] * dt.itemsize:
        raise BatchError(
            f"TokenFile({path!r}): the header promises {shape[0]} ids of {dt}, but the file is "
            f"{size} bytes, too short for them: it was cut short. Write it again."
        )
    return dt, offset, shape[0]


def _raw_layout(path: str, dtype: Any) -> tuple[np.dtype, int, int]:
    """The ids' dtype, offset 0 and their count, from a raw file's size."""
    if dtype is None:
        raise BatchError(
            f"TokenFile({path!r}): a raw token file does not record its dtype. Pass "
            "dtype=np.uint16 (nanoGPT's train.bin) or dtype=np.uint32, as the file was written."
        )
    dt = _check_dtype(dtype, path)
    size = os.path.getsize(path)
    if size % dt.itemsize:
        raise BatchError(
            f"TokenFile({path!r}, dtype={dt}): the file is {size} bytes, not a multiple of "
            f"{dt.itemsize} ({dt}'s size), so it was not written as {dt}. Pass the dtype it was "
            "written with (nanoGPT's train.bin is np.uint16), or fix a truncated file."
        )
    return dt, 0, size // dt.itemsize


class TokenFile:
    """A flat file of token ids on disk, read as sequences of `seq_len + 1` tokens.

    The file is memory-mapped, never read whole: a sequence's tokens are read
    when it is asked for, so a process reads only its own rows and a file far
    larger than memory trains as well as a small one. The mapping is read
    without read-ahead and unmapped after each read, so the process's resident
    memory does not grow with the part of the file it has read.

    Sequence `i` is tokens `[i * seq_len, i * seq_len + seq_len + 1)`:
    consecutive sequences share one token, so every token but the first is a
    target exactly once, and the last `(tokens - 1) % seq_len` tokens are left
    out.

    It is the dataset of `eqxpar.data.ShardedIterator` (whose batches are then
    `(local rows, seq_len + 1)` int32 arrays, `eqxpar.models.lm_loss`'s format)
    and a grain `RandomAccessDataSource` (`len`, `source[i]`; it pickles as its
    path, so grain's worker processes map the file themselves).

    **Arguments:**

    - `path`: a raw file of token ids (nanoGPT's `train.bin`) or a `.npy` file
      holding one flat integer array.
    - `seq_len`: tokens per sequence fed to the model; each read is `seq_len + 1`
      tokens (the inputs and their next-token targets).
    - `dtype`: the ids' type in a raw file (`np.uint16` for nanoGPT's files,
      `np.uint32` past 65,536 ids); taken from the header of a `.npy` file.

    **Raises:** `BatchError` when the file is missing, its size is not a multiple
    of the dtype's, it holds fewer than `seq_len + 1` tokens, or a `.npy` file is
    not one flat integer array.

    ```python
    import numpy as np, tempfile, os
    path = os.path.join(tempfile.mkdtemp(), "train.bin")
    np.arange(1000, dtype=np.uint16).tofile(path)
    tokens = eqxpar.data.TokenFile(path, seq_len=64, dtype=np.uint16)
    assert len(tokens) == 15 and tokens[1].tolist() == list(range(64, 129))
    ```
    """

    def __init__(self, path: str | os.PathLike, *, seq_len: int, dtype: Any = None):
        self._path = os.fspath(path)
        self._seq_len = _check_seq_len(seq_len)
        self._dtype_arg = dtype
        if not os.path.isfile(self._path):
            raise BatchError(
                f"TokenFile({self._path!r}): no such file. Pass the path of a token file "
                "(raw ids such as nanoGPT's train.bin, or a .npy array)."
            )
        layout = _npy_layout if self._path.endswith(".npy") else _raw_layout
        dt, self._offset, count = layout(self._path, dtype)
        self._map: mmap.mmap | None = None
        self._tokens = np.zeros((0,), dt)
        if count:  # mmap refuses an empty file; the length check below names the fix
            with open(self._path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if _ADVISE:
                # Rows are read in a random order: reading ahead of each would bring
                # in (and map) far more of the file than the rows.
                self._map.madvise(mmap.MADV_RANDOM)
            self._tokens = np.frombuffer(self._map, dt, count=count, offset=self._offset)
        need = self._seq_len + 1
        if self._tokens.shape[0] < need:
            raise BatchError(
                f"TokenFile({self._path!r}, seq_len={self._seq_len}): the file holds "
                f"{self._tokens.shape[0]} tokens, fewer than one sequence of seq_len + 1 = {need}. "
                f"Use seq_len <= {max(self._tokens.shape[0] - 1, 0)} or a longer file."
            )
        # Only types that can hold ids int32 cannot are checked on each read.
        self._check_range = self._tokens.dtype.itemsize >= 4 and self._tokens.dtype != _OUT
        self._check_sign = self._tokens.dtype.kind == "i"

    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    @property
    def seq_len(self) -> int:
        """Tokens per sequence fed to the model (each row has `seq_len + 1`)."""
        return self._seq_len

    @property
    def dtype(self) -> np.dtype:
        """The ids' type on disk (rows are read as int32)."""
        return self._tokens.dtype

    @property
    def num_tokens(self) -> int:
        """Token ids in the file."""
        return int(self._tokens.shape[0])

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self._seq_len

    def _index(self, i: SupportsIndex) -> int:
        n = len(self)
        k = operator.index(i)
        if not -n <= k < n:
            raise IndexError(f"TokenFile: sequence {k} is out of range; the file has {n} sequences.")
        return k % n

    def _checked(self, rows: np.ndarray) -> np.ndarray:
        if rows.size and (
            (self._check_range and rows.max() > _INT32_MAX) or (self._check_sign and rows.min() < 0)
        ):
            raise BatchError(
                f"TokenFile({self._path!r}): read ids from {rows.min()} to {rows.max()}, outside "
                f"[0, {_INT32_MAX}] ({self.dtype} on disk). Check the dtype the file was written "
                "with; token ids are non-negative and fit int32."
            )
        return rows.astype(_OUT, copy=False)

    def _copy(self, i: SupportsIndex, out: np.ndarray) -> None:
        start = self._index(i) * self._seq_len
        out[...] = self._tokens[start : start + self._seq_len + 1]

    def _release(self) -> None:
        # Unmap the pages just copied. They stay in the page cache, which the
        # kernel frees when memory runs short, but no longer count as this
        # process's memory: mapped pages would pile up, step after step, to the
        # whole file. The whole mapping goes, not the rows' pages: a fault maps
        # more than the page asked for (Linux's fault-around, and page-cache
        # folios of up to megabytes mapped whole).
        if _ADVISE and self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def __getitem__(self, i: SupportsIndex) -> Int[np.ndarray, " seq_plus_1"]:
        """Sequence `i`: `seq_len + 1` int32 ids (a grain data source's record)."""
        out = np.empty((self._seq_len + 1,), self.dtype)
        self._copy(i, out)
        self._release()
        return self._checked(out)

    def read(self, indices: Sequence[int] | np.ndarray) -> Int[np.ndarray, "rows seq_plus_1"]:
        """The sequences at `indices`, stacked: shape `(len(indices), seq_len + 1)`, int32.

        Only those sequences' bytes are read from the file.

        ```python
        batch = tokens.read([4, 0, 9])        # rows 4, 0 and 9, in that order
        ```
        """
        keys = np.asarray(indices).reshape(-1)
        out = np.empty((keys.shape[0], self._seq_len + 1), self._tokens.dtype)
        for row, i in enumerate(keys.tolist()):
            self._copy(i, out[row])
        self._release()
        return self._checked(out)

    def read_spans(
        self, starts: Sequence[int] | np.ndarray, stops: Sequence[int] | np.ndarray
    ) -> Int[np.ndarray, " tokens"]:
        """Token ids `[starts[k], stops[k])` of the file for each `k`, concatenated, int32.

        Offsets count tokens from the start of the file, not sequences: this reads
        the file as one flat array (`eqxpar.data.PackedTokens` reads its documents
        so). Only those tokens' bytes are read, and the mapping is released once.

        **Raises:** `BatchError` when the two have different lengths or a span is
        not inside `[0, num_tokens]`.

        ```python
        ids = tokens.read_spans([0, 500], [3, 502])     # tokens 0, 1, 2, 500 and 501
        ```
        """
        first = np.asarray(starts, dtype=np.int64).reshape(-1)
        last = np.asarray(stops, dtype=np.int64).reshape(-1)
        if first.shape != last.shape:
            raise BatchError(
                f"TokenFile.read_spans: {first.shape[0]} starts but {last.shape[0]} stops; "
                "pass one stop per start."
            )
        bad = (first < 0) | (last < first) | (last > self.num_tokens)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise BatchError(
                f"TokenFile.read_spans: span [{first[k]}, {last[k]}) is not inside the file's "
                f"{self.num_tokens} tokens; each span needs 0 <= start <= stop <= {self.num_tokens}."
            )
        out = np.empty((int((last - first).sum()),), self._tokens.dtype)
        at = 0
        for start, stop in zip(first.tolist(), last.tolist(), strict=True):
            out[at : at + stop - start] = self._tokens[start:stop]
            at += stop - start
        self._release()
        return self._checked(out)

    def __getstate__(self) -> dict[str, Any]:
        # A mapping cannot be pickled; a TokenFile carries its path, and the
        # unpickled copy (a grain worker) maps the file again.
        return {"path": self._path, "seq_len": self._seq_len, "dtype": self._dtype_arg}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], seq_len=state["seq_len"], dtype=state["dtype"])

    def __repr__(self) -> str:
        return (
            f"TokenFile({self._path!r}, seq_len={self._seq_len}, dtype={self.dtype}, "
            f"tokens={self.num_tokens}, sequences={len(self)})"
        )
