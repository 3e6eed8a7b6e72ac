"""The sharding table: every array leaf of a pytree, its spec and its bytes per device."""

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec
from jax.tree_util import keystr

from .._errors import EqxparError, PlanError
from .._plan import Plan
from .._rules import mesh_axis_names
from .._sizes import array_bytes
from .._specs import check_spec, is_array_like, leaves_with_axes
from .._text import fmt_int, render, short
from .._train._resolved_plan import ResolvedPlan
from .._train._train_state import specs_of


@dataclasses.dataclass(frozen=True)
class Row:
    """One array leaf of a sharding table.

    - `path`: the leaf's path in the tree, e.g. `".model.layers[0].weight"`.
    - `shape`, `dtype`: the global (unsharded) shape and the dtype's name.
    - `axes`: logical axis names declared with `eqxpar.param`, or None.
    - `spec`: the resolved `PartitionSpec`.
    - `split`: how many pieces the spec cuts the array into (product of the mesh
      sizes of the spec's axes); every other device holds a replica of a piece.
    - `bytes`: global bytes; `bytes_per_device`: `bytes // split`, the bytes each
      device holds.

    ```python
    row = eqxpar.inspect.sharding_table(model, plan).rows[0]
    row.path, row.spec, row.bytes_per_device   # ".w1", P(None, 'fsdp'), 512
    ```
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...] | None
    spec: PartitionSpec
    split: int
    bytes: int
    bytes_per_device: int


def _spec_text(spec: PartitionSpec) -> str:
    # "P('fsdp', None)": short, and what users write themselves.
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


@dataclasses.dataclass(frozen=True)
class ShardingTable:
    """Where every array leaf of a pytree lives on a plan's mesh.

    Built by `eqxpar.inspect.sharding_table`. `rows` holds one `Row` per array leaf
    (in `jax.tree.leaves` order); `bytes` and `bytes_per_device` are the totals;
    `str(table)` is a plain-text table and `table.rich()` a `rich.table.Table`
    (when rich is installed).

    ```python
    table = eqxpar.inspect.sharding_table(state, plan)
    print(table)
    assert table.bytes_per_device <= table.bytes
    ```
    """

    rows: tuple[Row, ...]
    mesh_shape: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        """Global bytes of all array leaves."""
        return sum(r.bytes for r in self.rows)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of all array leaves that each device holds."""
        return sum(r.bytes_per_device for r in self.rows)

    def _cells(self) -> tuple[list[str], list[list[str]], list[bool]]:
        header = ["path", "shape", "dtype", "logical axes", "spec", "bytes", "per device"]
        right = [False, False, False, False, False, True, True]
        rows = [
            [
                r.path,
                str(r.shape),
                r.dtype,
                "-" if r.axes is None else str(r.axes),
                _spec_text(r.spec),
                fmt_int(r.bytes),
                fmt_int(r.bytes_per_device),
            ]
            for r in self.rows
        ]
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape if v > 1) or "1 device"
        n = len(self.rows)
        total = f"total ({n} array{'s' if n != 1 else ''}, mesh {mesh})"
        rows.append([total, "", "", "", "", fmt_int(self.bytes), fmt_int(self.bytes_per_device)])
        return header, rows, right

    def __str__(self) -> str:
        header, rows, right = self._cells()
        return render(header, rows, right=right)

    def rich(self) -> Any:
        """The table as a `rich.table.Table` (needs `pip install rich`).

        ```python
        rich.print(eqxpar.inspect.sharding_table(state, plan).rich())
        ```
        """
        try:
            import rich.table
        except ImportError as e:
            raise EqxparError(
                "ShardingTable.rich() needs the rich package, which is not installed. "
                "Install it with `pip install rich`, or use str(table) for plain text."
            ) from e
        header, rows, right = self._cells()
        table = rich.table.Table(title="sharding table")
        for name, is_right in zip(header, right, strict=True):
            table.add_column(name, justify="right" if is_right else "left")
        for row in rows[:-1]:
            table.add_row(*row)
        table.add_section()
        table.add_row(*rows[-1])
        return table

    def __rich__(self) -> Any:
        # Lets `rich.print(table)` render the rich table directly.
        return self.rich()


def sharding_table(tree: Any, plan: Any, *, specs: Any = None) -> ShardingTable:
    """Tabulate how every array leaf of `tree` is laid out under `plan`.

    For each array leaf: its path, global shape, dtype, logical axes (from
    `eqxpar.param`), `PartitionSpec` (`eqxpar.partition_specs`) and the bytes each
    device holds (global bytes divided by the mesh sizes of the spec's axes).

    **Arguments:**

    - `tree`: any pytree with array leaves: a model, a `TrainState`, an optimizer
      state, or their `jax.eval_shape` outlines (nothing is allocated).
    - `plan`: the `eqxpar.Plan` whose mesh and rules give the specs.
    - `specs`: instead of the rules, one `PartitionSpec` for every array leaf (e.g.
      `plan.batch_spec` for a batch), or a pytree of them matching `tree`.

    **Returns:** a `ShardingTable` (`.rows`, `.bytes`, `.bytes_per_device`;
    `str(table)` is a plain-text table).

    **Raises:** `PlanError` when `plan` is not a Plan; `EqxparError` when `tree`
    has no array leaves or `specs` is neither a spec nor a spec tree; the spec
    errors of `eqxpar.partition_specs` when a spec does not fit its leaf.

    ```python
    table = eqxpar.inspect.sharding_table(state, plan)
    print(table)                 # path, shape, dtype, axes, spec, bytes, per device
    table.bytes_per_device       # what each device holds
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(
            f"sharding_table(tree, plan={plan!r}): expected an eqxpar.Plan; build one "
            "with eqxpar.Plan(eqxpar.make_mesh(...), rules=...)."
        )
    leaves = list(leaves_with_axes(tree))
    if not any(is_array_like(leaf) for _, leaf, _ in leaves):
        raise EqxparError(
            f"sharding_table(tree={type(tree).__name__} {short(tree)}, ...): the tree has no "
            "array leaves, so there is nothing to tabulate. Pass a model, a TrainState, a "
            "batch, or their jax.eval_shape outlines."
        )
    # The plan's specs are resolved here, when no `specs` are given; the helpers
    # below take the specs and the mesh, never the plan.
    if specs is None:
        spec_leaves = jax.tree.structure(tree).flatten_up_to(specs_of(tree, ResolvedPlan.of(plan)))
    else:
        spec_leaves = _spec_leaves(tree, specs)
    rows = [
        _row(path, leaf, axes, spec, plan.mesh)
        for (path, leaf, axes), spec in zip(leaves, spec_leaves, strict=True)
        if is_array_like(leaf)
    ]
    return ShardingTable(
        rows=tuple(rows), mesh_shape=tuple((str(k), int(v)) for k, v in plan.mesh.shape.items())
    )


def _spec_leaves(tree: Any, specs: Any) -> list[Any]:
    """One spec per leaf of `tree` from the caller's `specs`: one spec, or a spec tree."""
    treedef = jax.tree.structure(tree)
    if isinstance(specs, PartitionSpec):
        return [specs] * treedef.num_leaves
    try:
        return treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
        raise EqxparError(
            f"sharding_table(..., specs={short(specs)}): expected one PartitionSpec, "
            "or a pytree of PartitionSpecs with the structure of `tree` (as "
            "eqxpar.partition_specs returns). Pass one of those, or None for the plan's rules."
        ) from e


def _row(path: Any, leaf: Any, axes: Any, spec: Any, mesh: Mesh) -> Row:
    """The table row of one array leaf laid out by `spec`."""
    where = f"leaf {keystr(path) or '<root>'}"
    if not isinstance(spec, PartitionSpec):
        raise EqxparError(
            f"sharding_table: {where} got spec {spec!r}; every array leaf needs a "
            "PartitionSpec (PartitionSpec() for replicated)."
        )
    shape = tuple(int(d) for d in leaf.shape)
    check_spec(spec, shape, mesh, where=where)
    split = math.prod(mesh.shape[a] for e in spec for a in mesh_axis_names(e))
    # Typed PRNG keys count too (key<fry>: 8 bytes, two uint32).
    nbytes = array_bytes(shape, leaf.dtype)
    return Row(
        path=keystr(path) or "<root>",
        shape=shape,
        dtype=str(leaf.dtype),
        axes=axes,
        spec=spec,
        split=split,
        bytes=nbytes,
        bytes_per_device=nbytes // split,
    )
