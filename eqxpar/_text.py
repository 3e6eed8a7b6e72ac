"""Plain-text tables and byte counts for the inspection reports."""

from collections.abc import Sequence


def fmt_int(n: int) -> str:
    """`22684` -> `"22,684"`: exact, and still readable at a glance."""
    return f"{n:,}"


def fmt_ratio(value: float | None) -> str:
    """`1.0023` -> `"1.00x"`; None (nothing to compare with) -> `"n/a"`."""
    return "n/a" if value is None else f"{value:.2f}x"


def ratio(measured: int, reference: int | None) -> float | None:
    """`measured / reference`, or None when there is no (nonzero) reference."""
    if reference is None or reference == 0:
        return None
    return measured / reference


def render(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool]) -> str:
    """A table with one space-padded column per header entry, a rule under the
    header, and the columns flagged in `right` right-aligned (numbers)."""
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [cell.rjust(widths[i]) if right[i] else cell.ljust(widths[i]) for i, cell in enumerate(cells)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def short(value: object) -> str:
    """`repr(value)`, cut to 60 characters: enough to name a bad value in an error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
