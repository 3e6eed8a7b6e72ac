"""Pictures of how an array is laid out on the mesh: text, and PNG via matplotlib."""

import os
import pathlib
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, Sharding
from jaxtyping import Array, Shaped

from .._errors import EqxparError
from .._text import short

Target = Shaped[Array, "..."] | jax.ShapeDtypeStruct | Sharding


def _resolve(x: Target, shape: Sequence[int] | None, *, where: str) -> tuple[Sharding, tuple[int, ...], str]:
    # (sharding, global shape, "float32[8,8]"-style description).
    if isinstance(x, Sharding):
        if shape is None:
            raise EqxparError(
                f"{where}({short(x)}): a sharding alone has no shape, so its blocks are "
                f"unknown. Pass the array's shape too: {where}(sharding, shape=(rows, cols))."
            )
        dims = tuple(int(d) for d in shape)
        return x, dims, f"shape {dims}"
    if shape is not None:
        raise EqxparError(
            f"{where}(..., shape={tuple(shape)!r}): shape= is only for a bare sharding; an "
            f"array has its own shape {tuple(x.shape)}. Drop shape=."
        )
    if isinstance(x, jax.core.Tracer):
        raise EqxparError(
            f"{where}: got a traced value (inside jit or a transformation), whose sharding "
            "is not decided yet. Call it on a concrete array outside jit, or use "
            "jax.debug.inspect_array_sharding inside."
        )
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        raise EqxparError(
            f"{where}({short(x)}): this outline carries no sharding. Pass a placed array, "
            "or jax.ShapeDtypeStruct(shape, dtype, sharding=...)."
        )
    dims = tuple(int(d) for d in x.shape)
    return sharding, dims, f"{x.dtype}[{','.join(map(str, dims))}]"


def _ids(ids: list[int]) -> str:
    # [0, 1, 2, 3, 6] -> "0-3,6": a replicated block stays short.
    ids = sorted(ids)
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            a, b = ids[start], ids[i - 1]
            parts.append(str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}")
            start = i
    return ",".join(parts)


def _blocks(
    sharding: Sharding, shape: tuple[int, ...]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict[tuple[int, int], list[int]]]:
    """Row ranges, column ranges and the devices of each (row, column) cell.

    Rank 1 is one row of column blocks; rank 0 one cell; higher ranks are drawn
    by their first two dimensions."""
    cells: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        spans = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
        if len(shape) == 0:
            row, col = (0, 1), (0, 1)
        elif len(shape) == 1:
            row, col = (0, 1), spans[0]
        else:
            row, col = spans[0], spans[1]
        cells.setdefault((row, col), []).append(device.id)
    rows = sorted({r for r, _ in cells})
    cols = sorted({c for _, c in cells})
    grid = {(rows.index(r), cols.index(c)): ids for (r, c), ids in cells.items()}
    return rows, cols, grid


def _header(sharding: Sharding, what: str) -> str:
    if isinstance(sharding, NamedSharding):
        spec = "P(" + ", ".join(repr(e) for e in sharding.spec) + ")"
        mesh = " x ".join(f"{k}={v}" for k, v in sharding.mesh.shape.items() if v > 1) or "1 device"
        return f"{what}  {spec}  mesh {mesh}"
    return f"{what}  {type(sharding).__name__}"


def layout(x: Target, shape: Sequence[int] | None = None) -> str:
    """A text picture of which device holds which block of an array.

    Like `jax.debug.visualize_array_sharding`, but returns a string and needs no
    rich. Each cell is one block; it lists the ids of the devices holding it
    (`0-7`: a replica on devices 0 to 7). Column ranges run along the top and row
    ranges down the left. A 1-D array is one row of blocks; an array of rank 3 or
    more is drawn by its first two dimensions (a cell then lists every device
    holding some part of that block of them).

    **Arguments:**

    - `x`: a placed `jax.Array`, a `jax.ShapeDtypeStruct` with a sharding, or a
      `jax.sharding.Sharding` (then give `shape`).
    - `shape`: the global shape, only with a bare sharding.

    **Returns:** the picture, a multi-line string.

    **Raises:** `EqxparError` for a sharding without a shape, a shape given with
    an array, a traced value, or an outline without a sharding.

    ```python
    x = jax.device_put(jnp.zeros((8, 8)), plan.sharding(P("data", "tensor")))
    print(eqxpar.inspect.layout(x))
    # float32[8,8]  P('data', 'tensor')  mesh data=2 x tensor=4
    #        0:2   2:4   4:6   6:8
    #      +-----+-----+-----+-----+
    #  0:4 |  0  |  1  |  2  |  3  |
    #      +-----+-----+-----+-----+
    #  4:8 |  4  |  5  |  6  |  7  |
    #      +-----+-----+-----+-----+
    ```
    """
    sharding, dims, what = _resolve(x, shape, where="layout")
    rows, cols, grid = _blocks(sharding, dims)
    labels = {cell: _ids(ids) for cell, ids in grid.items()}
    col_text = [f"{a}:{b}" for a, b in cols] if dims else [""]
    row_text = [f"{a}:{b}" for a, b in rows] if len(dims) >= 2 else [""]
    width = max(max(len(t) for t in labels.values()), max(len(t) for t in col_text)) + 4
    left = max(len(t) for t in row_text)
    pad = " " * (left + 1) if left else ""
    rule = pad + "+" + "+".join("-" * width for _ in cols) + "+"
    lines = [_header(sharding, what)]
    if dims:
        lines.append(pad + " " + " ".join(t.center(width) for t in col_text).rstrip())
    lines.append(rule)
    for i, text in enumerate(row_text):
        cells = [labels.get((i, j), "").center(width) for j in range(len(cols))]
        prefix = text.rjust(left) + " " if left else ""
        lines.append(prefix + "|" + "|".join(cells) + "|")
        lines.append(rule)
    if len(dims) > 2:
        lines.append(f"(dims 0-1 of shape {dims}; devices in one cell may hold different parts of dims 2+)")
    return "\n".join(lines)


def save_layout_png(
    x: Target, path: str | os.PathLike, *, shape: Sequence[int] | None = None
) -> pathlib.Path:
    """Draw the layout picture of `x` into a PNG file with matplotlib.

    Blocks are drawn to scale, one colour per set of devices, labelled with the
    device ids (as in `layout`).

    **Arguments:**

    - `x`: a placed `jax.Array`, a `jax.ShapeDtypeStruct` with a sharding, or a
      `jax.sharding.Sharding` (then give `shape`).
    - `path`: the file to write.
    - `shape`: the global shape, only with a bare sharding.

    **Returns:** the path written, as a `pathlib.Path`.

    **Raises:** `EqxparError` when matplotlib is not installed (`pip install
    eqxpar[examples]`), and for the inputs `layout` rejects.

    ```python
    eqxpar.inspect.save_layout_png(state.model.layers[0].weight, "weight.png")
    ```
    """
    sharding, dims, what = _resolve(x, shape, where="save_layout_png")
    try:
        # Imported here: matplotlib is an optional extra and slow to import.
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise EqxparError(
            "save_layout_png needs matplotlib, which is not installed. Install it with "
            "`pip install eqxpar[examples]` (or `pip install matplotlib`), or use "
            "eqxpar.inspect.layout(x) for a text picture."
        ) from e
    rows, cols, grid = _blocks(sharding, dims)
    height, width = rows[-1][1], cols[-1][1]
    # Height follows the array's aspect ratio (within reason), so blocks look to scale.
    aspect = min(max(max(height, 1) / max(width, 1), 0.2), 2.0)
    figure = Figure(figsize=(6, 6 * aspect))
    axes = figure.add_subplot()
    colours: dict[str, int] = {}
    for (i, j), ids in grid.items():
        label = _ids(ids)
        colour = colours.setdefault(label, len(colours))
        (r0, r1), (c0, c1) = rows[i], cols[j]
        axes.add_patch(
            Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=f"C{colour % 10}", edgecolor="black", alpha=0.6)
        )
        axes.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center")
    axes.set_xlim(0, width)
    axes.set_ylim(height, 0)  # row 0 at the top, as in the text picture
    axes.set_title(_header(sharding, what), fontsize=9)
    out = pathlib.Path(path)
    figure.savefig(out, format="png")
    return out
