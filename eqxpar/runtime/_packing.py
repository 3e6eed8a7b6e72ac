"""Packing documents into rows of a fixed length: which piece of which document
goes where, computed from the documents' lengths alone (no token is read).

The layout is a pure function of the lengths and the options, so every process
computes the same one and reads only its own rows' tokens. Rows are numbered in
the order they are closed (filled, or pushed out by a document that fits no open
row), which for one open row is the documents' order.
"""

import array
import dataclasses

import numpy as np
from jaxtyping import Bool, Int

SPLITS = ("long", "always", "never")


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Pieces of documents, row by row: row `i` holds pieces
    `[row_start[i], row_start[i + 1])`, left to right, each at `column` of its row
    and taking `length` ids from `offset` of its `document`."""

    row_start: Int[np.ndarray, " rows_plus_1"]
    document: Int[np.ndarray, " pieces"]
    offset: Int[np.ndarray, " pieces"]
    length: Int[np.ndarray, " pieces"]
    column: Int[np.ndarray, " pieces"]

    @property
    def rows(self) -> int:
        return int(self.row_start.shape[0] - 1)

    @property
    def segment(self) -> Int[np.ndarray, " pieces"]:
        """Each piece's segment id in its row: 1 for the first piece, 2 for the next..."""
        counts = np.diff(self.row_start)
        first = np.repeat(self.row_start[:-1], counts)
        return (np.arange(self.document.shape[0]) - first + 1).astype(np.int32)

    @property
    def continues(self) -> Bool[np.ndarray, " pieces"]:
        """Pieces that do not start their document (the rest of a split one)."""
        return self.offset > 0


class _Rows:
    """Rows being filled: each piece placed, the rows open, the rows closed in order."""

    def __init__(self, row_len: int, open_rows: int):
        self.row_len, self.open_rows = row_len, open_rows
        # One column each of (row, column, document, offset, length): 8 bytes a
        # value, where a list of tuples would hold about 150 bytes a piece.
        self.pieces = tuple(array.array("q") for _ in range(5))
        self._append = tuple(column.append for column in self.pieces)
        self.fill: list[int] = []
        self.open: list[int] = []
        self.closed: list[int] = []

    def put(self, row: int, document: int, offset: int, length: int) -> None:
        fill = self.fill
        to_row, to_column, to_document, to_offset, to_length = self._append
        to_row(row)
        to_column(fill[row])
        to_document(document)
        to_offset(offset)
        to_length(length)
        fill[row] += length
        if fill[row] == self.row_len:
            self.open.remove(row)
            self.closed.append(row)

    def open_row(self) -> int:
        if len(self.open) == self.open_rows:  # no room for another: the oldest is done
            self.closed.append(self.open.pop(0))
        self.fill.append(0)
        self.open.append(len(self.fill) - 1)
        return self.open[-1]

    def place(self, document: int, offset: int, length: int) -> None:
        """First fit: the oldest open row with room for the piece whole, else a new row."""
        for row in self.open:
            if self.row_len - self.fill[row] >= length:
                self.put(row, document, offset, length)
                return
        self.put(self.open_row(), document, offset, length)


def _whole(rows: _Rows, lengths: list[int], *, truncate: bool) -> None:
    # A document goes whole into a row; one longer than a row is cut into row-long
    # pieces that share one id with the next, or keeps its first row's worth
    # (`truncate`).
    length_of_row = rows.row_len
    for document, n in enumerate(lengths):
        n = min(n, length_of_row) if truncate else n
        offset = 0
        while n - offset > length_of_row:
            rows.place(document, offset, length_of_row)
            offset += length_of_row - 1
        rows.place(document, offset, n - offset)


def _filled(rows: _Rows, lengths: list[int]) -> None:
    # Every row filled to its end: a document that does not fit the row's room
    # fills it and continues in the next row, from the last id it placed.
    for document, n in enumerate(lengths):
        offset = 0
        while True:
            row = rows.open[0] if rows.open else rows.open_row()
            room = rows.row_len - rows.fill[row]
            if n - offset <= room:
                rows.put(row, document, offset, n - offset)
                break
            if room >= 2:  # one id alone would be a target of nothing, and is read again next row
                rows.put(row, document, offset, room)
                offset += room - 1
            if row in rows.open:
                rows.open.remove(row)
                rows.closed.append(row)


def pack_documents(
    lengths: Int[np.ndarray, " documents"], *, row_len: int, open_rows: int, split: str, drop_last: bool
) -> RowLayout:
    """Lay documents of `lengths` ids, in that order, into rows of `row_len` ids.

    `split`: "long" cuts only documents longer than a row; "always" fills every
    row, a document continuing in the next (needs `open_rows == 1`); "never"
    truncates documents longer than a row. `open_rows` rows are filled at once
    (first fit); 1 is sequential greedy packing. `drop_last` drops the rows still
    open when the documents run out (partly filled) instead of padding them.
    """
    rows = _Rows(row_len, open_rows)
    if split == "always":
        _filled(rows, lengths.tolist())
    else:
        _whole(rows, lengths.tolist(), truncate=split == "never")
    if not drop_last:
        rows.closed.extend(rows.open)
    rank = np.full((len(rows.fill),), -1, np.int64)
    rank[np.asarray(rows.closed, np.int64)] = np.arange(len(rows.closed))
    table = np.stack([np.frombuffer(column, np.int64) for column in rows.pieces], axis=1).reshape(-1, 5)
    row = rank[table[:, 0]]
    keep = row >= 0
    table, row = table[keep], row[keep]
    order = np.lexsort((table[:, 1], row))
    table, row = table[order], row[order]
    row_start = np.searchsorted(row, np.arange(len(rows.closed) + 1)).astype(np.int64)
    return RowLayout(
        row_start=row_start,
        document=table[:, 2],
        offset=table[:, 3],
        length=table[:, 4].astype(np.int32),
        column=table[:, 1].astype(np.int32),
    )
