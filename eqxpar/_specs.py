"""Resolve rules over a pytree into PartitionSpecs, and check specs against arrays."""

import math
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec
from jax.tree_util import GetAttrKey, keystr

from ._errors import AxisNameError, DivisibilityError, SpecError
from ._param import field_axes, field_leading
from ._rules import Leaf, Rule, as_rules, mesh_axis_names


def is_array_like(x: Any) -> bool:
    """Arrays, numpy arrays and `jax.ShapeDtypeStruct`s: leaves that take a spec."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _children(node: Any) -> list[tuple[Any, Any]]:
    # One level of the pytree below `node`, with keys, in flattening order.
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(path[0], child) for path, child in flat]


def leaves_with_axes(tree: Any) -> Iterator[tuple[tuple, Any, tuple | None]]:
    """Yield `(path, leaf, logical_axes)` for every leaf, in `jax.tree.leaves` order.

    The logical axes of a leaf come from the field metadata of the module that
    holds it directly, so gradients and optax moments (which reuse the model's
    module classes) report the same axes as the parameters. Below a stacked field
    (`eqxpar.stacked`) the stack's leading names are prepended.
    """
    for path, leaf, axes, _ in leaves_with_layout(tree):
        yield path, leaf, axes


def leaves_with_layout(tree: Any) -> Iterator[tuple[tuple, Any, tuple | None, int]]:
    """As `leaves_with_axes`, plus the number of leading stack dimensions of each
    leaf (0 outside stacked fields)."""

    def visit(node, path, axes, leading):
        structure = jax.tree.structure(node)
        if structure.num_nodes == 1 and structure.num_leaves == 1:
            declared = None if axes is None else leading + axes
            yield path, node, declared, len(leading)
            return
        for key, child in _children(node):
            child_axes = None
            child_leading = leading
            if isinstance(node, eqx.Module) and isinstance(key, GetAttrKey):
                child_axes = field_axes(node, key.name)
                child_leading = leading + field_leading(node, key.name)
            yield from visit(child, path + (key,), child_axes, child_leading)

    yield from visit(tree, (), None, ())


def drop_axes(spec: PartitionSpec, drop: frozenset[str] | set[str]) -> PartitionSpec:
    """`spec` with the mesh axes in `drop` removed (entries left empty become None)."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in mesh_axis_names(entry) if a not in drop)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def check_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh | None, *, where: str) -> None:
    """Raise an eqxpar error if `spec` cannot split an array of `shape` on `mesh`."""
    if len(spec) > len(shape):
        raise SpecError(
            f"{where}: spec {spec} has {len(spec)} entries but the array has rank "
            f"{len(shape)} (shape {shape}). Give at most {len(shape)} entries."
        )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        names = mesh_axis_names(entry)
        for name in names:
            if mesh is not None and name not in mesh.axis_names:
                raise AxisNameError(
                    f"{where}: spec {spec} names mesh axis {name!r}, but the mesh has "
                    f"axes {tuple(mesh.axis_names)}. Use one of those names."
                )
            if name in seen:
                raise SpecError(
                    f"{where}: spec {spec} uses mesh axis {name!r} for two dimensions; "
                    "a mesh axis can split only one dimension of an array."
                )
            seen.add(name)
        if mesh is not None and names:
            size = math.prod(mesh.shape[n] for n in names)
            if shape[dim] % size:
                raise DivisibilityError(
                    f"{where}: dimension {dim} of shape {shape} has size {shape[dim]}, "
                    f"which is not divisible by the {size} devices of mesh axes {names}. "
                    f"Make it a multiple of {size}, or do not split that dimension."
                )


def partition_specs(tree: Any, rules: Any, *, mesh: Mesh | None = None) -> Any:
    """Resolve the PartitionSpec of every array leaf of `tree`.

    Works on any pytree that mirrors a model: the model itself, its gradients, an
    optax state built from it, or their `jax.eval_shape` outlines. Scalars are
    replicated; every other array leaf gets the first spec a rule returns, or is
    replicated when no rule claims it; non-array leaves get None.

    **Arguments:**

    - `tree`: any pytree.
    - `rules`: an `eqxpar.Plan` (its rules and mesh), a rule, or a sequence of
      rules. (Where a train step puts a whole `TrainState`, the optimizer state
      under ZeRO-1 included, is its `eqxpar.internal.StepLayout`.)
    - `mesh`: the mesh to check the specs against, when `rules` is not a plan.

    **Returns:** a pytree of the same structure with a `PartitionSpec` at every array
    leaf and None elsewhere; usable as `shard_map` specs.

    **Raises:** `SpecError`, `AxisNameError`, `DivisibilityError` when a resolved
    spec does not fit its leaf, naming the leaf's path.

    ```python
    specs = eqxpar.partition_specs(model, plan)
    grad_specs = eqxpar.partition_specs(eqx.filter(model, eqx.is_inexact_array), plan)
    ```
    """
    from ._plan import Plan

    if isinstance(rules, Plan):
        mesh, rules = rules.mesh, rules.rules
    rule_list: tuple[Rule, ...] = as_rules(rules)
    _, treedef = jax.tree.flatten(tree)
    specs = []
    for path, leaf, axes, leading in leaves_with_layout(tree):
        if not is_array_like(leaf):
            specs.append(None)
            continue
        shape = tuple(leaf.shape)
        where = f"leaf {keystr(path) or '<root>'}"
        if axes is not None and len(axes) != len(shape):
            raise SpecError(
                f"{where}: its field declares logical axes {axes} ({len(axes)} names) "
                f"but the array has rank {len(shape)} (shape {shape}). Declare one name "
                "(or None) per dimension in eqxpar.param(axes=...)."
            )
        spec = PartitionSpec()
        if shape:
            info = Leaf(
                path=keystr(path), shape=shape, dtype=leaf.dtype, axes=axes, mesh=mesh, leading=leading
            )
            for rule in rule_list:
                found = rule.spec(info)
                if found is not None:
                    if not isinstance(found, PartitionSpec | tuple | list):
                        # A bare string would become a spec of its letters.
                        raise SpecError(
                            f"{where}: rule {rule!r} returned {found!r}; a rule returns a PartitionSpec "
                            "(or a tuple of its entries), or None to leave the leaf to the next rule, "
                            f"e.g. PartitionSpec({found!r})."
                        )
                    spec = found if isinstance(found, PartitionSpec) else PartitionSpec(*found)
                    break
        check_spec(spec, shape, mesh, where=where)
        specs.append(spec)
    return jax.tree.unflatten(treedef, specs)
