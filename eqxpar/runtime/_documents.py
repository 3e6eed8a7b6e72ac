"""Documents in a flat array of token ids: where each starts and how long it is.

A training set of documents is often written as one array of ids with an
end-of-document id after each document (GPT-2's `<|endoftext|>`). `FlatIds`
reads such ids from a `TokenFile` or an array in memory, and `find_documents`
scans them once, a few million ids at a time, for the end-of-document id: a
document is the ids after the previous end-of-document id up to and including
its own (the file's last document may lack one). Only the documents' offsets
and lengths are kept, 16 bytes a document.
"""

from typing import Any

import numpy as np
from jaxtyping import Int

from .._errors import BatchError
from ._token_file import TokenFile

# Ids scanned at a time: 4 Mi ids is 8 MiB of uint16 on disk, 16 MiB as int32.
_CHUNK = 1 << 22
_INT32_MAX = int(np.iinfo(np.int32).max)


class FlatIds:
    """The ids of a `TokenFile` or of a 1-D integer array, read by flat offsets."""

    def __init__(self, source: Any, where: str):
        if isinstance(source, TokenFile):
            self.file: TokenFile | None = source
            self.array = np.zeros((0,), np.int32)
            self.dtype, self.num_tokens = source.dtype, source.num_tokens
            return
        array = np.asarray(source) if hasattr(source, "__array__") else None
        if array is None or array.ndim != 1 or array.dtype.kind not in "iu":
            described = type(source).__name__
            if array is not None:
                described = f"{array.dtype} array of shape {array.shape}"
            raise BatchError(
                f"{where}: the token ids are a {described}; expected an eqxpar.data.TokenFile or "
                "one flat integer array of ids (documents separated by the end-of-document id)."
            )
        self.file, self.array = None, array
        self.dtype, self.num_tokens = array.dtype, int(array.shape[0])

    def read_spans(self, starts: np.ndarray, stops: np.ndarray) -> Int[np.ndarray, " tokens"]:
        """Ids `[starts[k], stops[k])` for each `k`, concatenated, as int32."""
        if self.file is not None:
            return self.file.read_spans(starts, stops)
        parts = [self.array[a:b] for a, b in zip(starts.tolist(), stops.tolist(), strict=True)]
        if not parts:
            return np.zeros((0,), np.int32)
        return np.concatenate(parts).astype(np.int32, copy=False)

    def chunk(self, start: int) -> np.ndarray:
        """Up to `_CHUNK` ids from `start`, in their stored type (for scanning)."""
        stop = min(start + _CHUNK, self.num_tokens)
        if self.file is not None:
            return self.file.read_spans(np.asarray([start]), np.asarray([stop]))
        return self.array[start:stop]


def check_eod(eod_id: Any, ids: FlatIds, vocab_size: int | None, where: str) -> int:
    """`eod_id` as an int, or a `BatchError` naming it when it cannot be an id of `ids`."""
    if not isinstance(eod_id, int | np.integer) or isinstance(eod_id, bool) or eod_id < 0:
        raise BatchError(
            f"{where}: eod_id={eod_id!r} is not a token id; expected an integer >= 0, the id that "
            "ends each document (GPT-2's <|endoftext|> is 50256)."
        )
    if vocab_size is not None and eod_id >= vocab_size:
        raise BatchError(
            f"{where}: eod_id={eod_id} is outside the vocabulary of vocab_size={vocab_size} ids "
            f"[0, {vocab_size}). Pass the end-of-document id of the tokenizer that wrote the ids."
        )
    largest = min(int(np.iinfo(ids.dtype).max), _INT32_MAX)
    if eod_id > largest:
        raise BatchError(
            f"{where}: eod_id={eod_id} cannot occur in ids of type {ids.dtype} (at most {largest}). "
            "Pass the end-of-document id the ids were written with, or the dtype they were written in."
        )
    return int(eod_id)


def _check_ids(chunk: np.ndarray, start: int, vocab_size: int | None, where: str) -> None:
    if chunk.size == 0:
        return
    low, high = int(chunk.min()), int(chunk.max())
    limit = _INT32_MAX if vocab_size is None else vocab_size - 1
    if low < 0 or high > limit:
        bad = int(np.flatnonzero((chunk < 0) | (chunk > limit))[0])
        value = int(chunk[bad])
        expected = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else f"[0, {_INT32_MAX}]"
        raise BatchError(
            f"{where}: token id {value} at position {start + bad} is outside {expected}. Check "
            "the vocab_size of the model and the dtype the ids were written with."
        )


def find_documents(
    ids: FlatIds, eod_id: int, vocab_size: int | None, where: str
) -> tuple[Int[np.ndarray, " documents"], Int[np.ndarray, " documents"]]:
    """The first offset and the length of each document of `ids`, split after each `eod_id`.

    Reads every id once, checks each is in the vocabulary (or fits int32), and
    raises a `BatchError` when `eod_id` never occurs (a wrong id would otherwise
    make the whole file one document).
    """
    ends = []
    for start in range(0, ids.num_tokens, _CHUNK):
        chunk = ids.chunk(start)
        _check_ids(chunk, start, vocab_size, where)
        ends.append(np.flatnonzero(chunk == eod_id).astype(np.int64) + (start + 1))
    stops = np.concatenate(ends) if ends else np.zeros((0,), np.int64)
    if stops.size == 0:
        raise BatchError(
            f"{where}: eod_id={eod_id} never occurs in the {ids.num_tokens} token ids, so there "
            "are no documents to pack. Pass the id that ends each document in these ids."
        )
    if stops[-1] != ids.num_tokens:  # the last document need not end with eod_id
        stops = np.append(stops, np.int64(ids.num_tokens))
    starts = np.concatenate([np.zeros((1,), np.int64), stops[:-1]])
    return starts, stops - starts
