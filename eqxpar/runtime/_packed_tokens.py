"""Documents packed into rows of a fixed length, each row with its segment ids,
positions and loss weights: a dataset of `ShardedIterator` (and grain) whose
examples are the packed rows.

Packing is done once, from the documents' lengths, when the dataset is built;
each row's ids are read from the file only when the row is asked for. The rows
are then one fixed dataset: `ShardedIterator` shuffles them each epoch, splits
each global batch over the processes and saves its position, as for any other.
"""

import dataclasses
import operator
import os
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np
from jaxtyping import Int

from .._errors import BatchError
from ._documents import FlatIds, check_eod, find_documents
from ._packing import SPLITS, pack_documents
from ._token_file import TokenFile

FIELDS = ("tokens", "segment_ids", "positions", "weights")


def _check_int(value: Any, name: str, low: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise BatchError(f"PackedTokens: {name}={value!r} is not valid; expected an integer >= {low}.")
    return int(value)


def _check_seq_len(seq_len: Any, tokens: Any) -> int:
    if seq_len is None and isinstance(tokens, TokenFile):
        return tokens.seq_len
    if not isinstance(seq_len, int | np.integer) or isinstance(seq_len, bool) or seq_len < 1:
        raise BatchError(
            f"PackedTokens: seq_len={seq_len!r} gives rows of seq_len + 1 ids, and a row needs at "
            "least 2 (an input and its target); expected an integer >= 1 (the model's sequence "
            "length; it defaults to a TokenFile's seq_len)."
        )
    return int(seq_len)


def _check_options(split: Any, open_rows: int) -> str:
    if split not in SPLITS:
        raise BatchError(f"PackedTokens: split={split!r} is not one of {SPLITS}.")
    if split == "always" and open_rows != 1:
        raise BatchError(
            f"PackedTokens: split='always' fills each row to its end before the next, so it packs "
            f"one row at a time; open_rows={open_rows} needs split='long' or 'never'."
        )
    return split


class PackedTokens:
    """Documents of a token file packed into rows of `seq_len + 1` ids, with their
    segment ids, positions and loss weights.

    The ids are split into documents after each `eod_id` (a document keeps its
    `eod_id`; the last one may lack it), and the documents are laid into rows
    (`open_rows` rows filled at once; `split` says what happens to a document that
    does not fit). Row `i` is a dict of four `(seq_len + 1,)` arrays, aligned with
    its ids as `eqxpar.models.lm_loss` takes them (inputs `tokens[:-1]`, targets
    `tokens[1:]`):

    - `tokens` (int32): the ids; padding is `eod_id`.
    - `segment_ids` (int32): 1 for the row's first piece of a document, 2 for the
      next, ...; 0 for padding (its own segment). Tokens attend only within their
      segment: pass `segment_ids[:-1]` for the inputs.
    - `positions` (int32): each id's place in its piece, from 0 at each piece's
      start (0 for padding): pass `positions[:-1]` for the inputs.
    - `weights` (float32): the loss weight of each id as a *target*, predicted
      from the id before it: pass `weights[1:]` for the targets. 1 for every id
      of a piece but its first; 0 for padding, for `weights[0]`, and for a
      document's first id (predicted from another document; with
      `mask_boundaries=False` it is 1 where the document does not start the row).

    A document longer than a row (`split="long"`, the default) is cut into
    row-long pieces, each starting a row and repeating the previous piece's last
    id as its first: that id is an input there, not a target, so each id of the
    document but the first is a target exactly once, and positions restart at 0
    in each piece (the inputs' stay below `seq_len`, so a model's
    `max_seq_len >= seq_len` suffices, as unpacked). `split="always"` fills
    every row to its end (a document that does not fit continues in the next row,
    the same way), so only the last row has padding; `split="never"` keeps a long
    document's first `seq_len + 1` ids and drops the rest.

    The rows are a dataset: `len(packed)`, `packed[i]` (a grain data source's
    record) and `packed.read(indices)` (the rows stacked, `(rows, seq_len + 1)`
    each), the form `eqxpar.data.ShardedIterator` reads, so each process reads
    from disk only its rows of each global batch, and the iterator's
    `{"step", "seed"}` state resumes the rows.

    Building it reads the ids once, a few million at a time, to find the
    documents, and packs them in a Python loop over the documents; it then keeps
    8 bytes per document, 28 per piece (a document, or a part of a longer one)
    and 8 per row.

    **Arguments:**

    - `tokens`: an `eqxpar.data.TokenFile` or one flat integer array of ids.
    - `eod_id` (keyword-only): the id that ends each document.
    - `seq_len`: rows are `seq_len + 1` ids (default: the `TokenFile`'s `seq_len`).
    - `open_rows`: rows filled at once. 1 (default) is sequential greedy packing:
      a document goes into the current row if it fits, else the row is padded
      and a new one started, so rows keep the documents' order. More is first
      fit: a document goes into the oldest open row with room for it, and when
      none has room the oldest row is closed; less padding, rows hold documents
      out of order.
    - `split`: `"long"`, `"always"` or `"never"`, above (`"always"` needs
      `open_rows=1`).
    - `mask_boundaries`: weigh a document's first id 0 (default True, so each
      document is trained as if alone in its row: a packed batch gives the loss
      of its documents run one per row and padded). False suits rows fed without
      their `segment_ids` (attention across documents, as in unpacked
      pretraining), where only padding is left out; a loss that reads the segment
      ids (`eqxpar.models.lm_loss`) leaves predictions across them out anyway.
    - `drop_last`: drop the rows still partly filled when the documents run out,
      instead of padding them (default False).
    - `seed`: None (default) packs the documents in their order in the file; an
      integer packs them in a permutation seeded by it, so neighbours in the file
      need not share rows. (`ShardedIterator` shuffles the rows each epoch either way.)
    - `vocab_size`: when given, `eod_id` and every id must be below it.

    **Raises:** `BatchError` naming the value when `eod_id` is negative, outside
    the vocabulary or the ids' type, or never occurs; when an id is outside the
    vocabulary; when `seq_len < 1` (a row needs at least 2 ids); or when an
    option is not one of its values.

    ```python
    ids = np.array([5, 6, 7, 0, 8, 9, 0, 3, 0])       # three documents, each ending with eod_id 0
    packed = eqxpar.data.PackedTokens(ids, eod_id=0, seq_len=5)      # rows of 6 ids
    row = packed[1]                                   # row 0 is document 1 and padding
    assert row["tokens"].tolist() == [8, 9, 0, 3, 0, 0]              # documents 2 and 3, then padding
    assert row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0]
    assert row["positions"].tolist() == [0, 1, 2, 0, 1, 0]
    assert row["weights"].tolist() == [0, 1, 1, 0, 1, 0]             # targets: tokens[1:]
    ```
    """

    def __init__(
        self,
        tokens: TokenFile | np.ndarray | Sequence[int],
        *,
        # Any: checked below, with an eqxpar error that names the value.
        eod_id: Any,
        seq_len: Any = None,
        open_rows: int = 1,
        split: str = "long",
        mask_boundaries: bool = True,
        drop_last: bool = False,
        seed: int | None = None,
        vocab_size: int | None = None,
    ):
        self._ids = FlatIds(tokens, "PackedTokens")
        if vocab_size is not None:
            vocab_size = _check_int(vocab_size, "vocab_size", 1)
        self._eod_id = check_eod(eod_id, self._ids, vocab_size, "PackedTokens")
        self._seq_len = _check_seq_len(seq_len, tokens)
        open_rows = _check_int(open_rows, "open_rows", 1)
        self._split = _check_options(split, open_rows)
        self._mask_boundaries = bool(mask_boundaries)
        self._seed = None if seed is None else _check_int(seed, "seed", 0)
        self._starts, lengths = find_documents(self._ids, self._eod_id, vocab_size, "PackedTokens")
        order = np.arange(lengths.shape[0])
        if self._seed is not None:
            order = np.random.default_rng(self._seed).permutation(lengths.shape[0])
        layout = pack_documents(
            lengths[order],
            row_len=self._seq_len + 1,
            open_rows=open_rows,
            split=split,
            drop_last=bool(drop_last),
        )
        if layout.rows == 0:
            raise BatchError(
                f"PackedTokens: drop_last=True dropped every row: the {lengths.shape[0]} documents "
                f"({int(lengths.sum())} ids) do not fill one row of seq_len + 1 = {self._seq_len + 1}. "
                "Use drop_last=False or a shorter seq_len."
            )
        # The pieces' documents, numbered in the file's order.
        self._layout = dataclasses.replace(layout, document=order[layout.document])
        self._segment = layout.segment
        self._open_rows = open_rows

    @property
    def seq_len(self) -> int:
        """Rows are `seq_len + 1` ids."""
        return self._seq_len

    @property
    def eod_id(self) -> int:
        """The id that ends each document (and pads rows)."""
        return self._eod_id

    @property
    def num_documents(self) -> int:
        """Documents found in the ids."""
        return int(self._starts.shape[0])

    @property
    def fill(self) -> float:
        """The fraction of the rows' ids that are documents' ids (the rest is padding)."""
        return float(self._layout.length.sum()) / (len(self) * (self._seq_len + 1))

    def __len__(self) -> int:
        return self._layout.rows

    def _rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if rows.size and (rows.min() < -n or rows.max() >= n):
            bad = int(rows[(rows < -n) | (rows >= n)][0])
            raise IndexError(f"PackedTokens: row {bad} is out of range; there are {n} rows.")
        return rows % n

    def segments(self, i: SupportsIndex) -> Int[np.ndarray, "segments 3"]:
        """What row `i` holds: one `(document, start, stop)` per segment, in order.

        Segment `k + 1` of the row is ids `[start, stop)` of document `document`
        (documents numbered in the file's order, ids counted from the document's
        first).

        ```python
        packed.segments(0)          # array([[0, 0, 4]]): document 0's 4 ids
        ```
        """
        (row,) = self._rows([operator.index(i)])
        lo, hi = self._layout.row_start[row], self._layout.row_start[row + 1]
        offset = self._layout.offset[lo:hi]
        return np.stack([self._layout.document[lo:hi], offset, offset + self._layout.length[lo:hi]], axis=1)

    def read(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The rows at `indices`, stacked: a dict of `tokens`, `segment_ids`,
        `positions` (int32) and `weights` (float32), each `(len(indices), seq_len + 1)`.

        Only those rows' ids are read.

        ```python
        batch = packed.read([4, 0])          # batch["tokens"].shape == (2, seq_len + 1)
        ```
        """
        rows = self._rows(indices)
        lay = self._layout
        counts = lay.row_start[rows + 1] - lay.row_start[rows]
        piece = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        piece = piece + np.repeat(lay.row_start[rows], counts)
        length = lay.length[piece].astype(np.int64)
        start = self._starts[lay.document[piece]] + lay.offset[piece]
        ids = self._ids.read_spans(start, start + length)
        # A row's pieces lie side by side from its first column, padding after them,
        # so its ids, in row-major order, are the pieces' ids in order: a mask of the
        # rows' filled columns places them all without an index per id.
        row_of = np.repeat(np.arange(rows.shape[0]), counts)
        used = np.bincount(row_of, weights=length, minlength=rows.shape[0]).astype(np.int64)
        filled = np.arange(self._seq_len + 1) < used[:, None]
        of = np.repeat(np.arange(piece.shape[0]), length)  # each id's piece
        within = np.arange(ids.shape[0]) - np.repeat(np.cumsum(length) - length, length)
        target = within > 0
        if not self._mask_boundaries:  # a document's first id, where another precedes it in the row
            target |= (~lay.continues[piece] & (lay.column[piece] > 0))[of]
        shape = filled.shape
        out = {
            "tokens": np.full(shape, self._eod_id, np.int32),
            "segment_ids": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
            "weights": np.zeros(shape, np.float32),
        }
        out["tokens"][filled] = ids
        out["segment_ids"][filled] = np.repeat(self._segment[piece], length)
        out["positions"][filled] = within
        out["weights"][filled] = target
        return out

    def __getitem__(self, i: SupportsIndex) -> dict[str, np.ndarray]:
        """Row `i`: the dict `read([i])` gives, each array `(seq_len + 1,)`."""
        return {name: value[0] for name, value in self.read([operator.index(i)]).items()}

    def __repr__(self) -> str:
        source = self._ids.file.path if self._ids.file is not None else f"{self._ids.num_tokens} ids"
        return (
            f"PackedTokens({os.fspath(source)!r}, eod_id={self._eod_id}, seq_len={self._seq_len}, "
            f"open_rows={self._open_rows}, split={self._split!r}, documents={self.num_documents}, "
            f"rows={len(self)}, fill={self.fill:.3f})"
        )
