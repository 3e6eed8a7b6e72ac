"""Rules: how a leaf of a pytree is mapped to a PartitionSpec.

A rule looks at one leaf (its path, shape and declared logical axes) and either
returns a `PartitionSpec` or `None` ("no opinion"). A plan holds a sequence of rules;
the first that returns a spec wins and a leaf no rule claims is replicated. Because
rules look only at paths, shapes and field metadata, the same rules give an optax
state (whose moments reuse the model's module classes and paths) the sharding of
the parameters it mirrors, with no user code.
"""

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from jax.sharding import Mesh, PartitionSpec

from ._errors import AxisNameError, UnmatchedLeafError

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Leaf:
    """What a rule sees of one array leaf.

    - `path`: the leaf's key path as a string, as `jax.tree_util.keystr` writes it
      (e.g. `".layers[0].weight"`, or `"[0].mu.layers[0].weight"` inside an optax
      state).
    - `shape`, `dtype`: the leaf's global shape and dtype.
    - `axes`: the logical axis names declared with `eqxpar.param`, or None.
    - `mesh`: the mesh the spec is for (None when resolving without one).
    - `leading`: how many leading dimensions are stack dimensions (one per layer
      of an `eqxpar.nn.Stacked`, or per pipeline stage); 0 for ordinary leaves.
      `axes`, when declared, already starts with their names.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...] | None
    mesh: Mesh | None
    leading: int = 0


@runtime_checkable
class Rule(Protocol):
    """Anything with `spec(leaf) -> PartitionSpec | None` is a rule."""

    def spec(self, leaf: Leaf) -> PartitionSpec | None: ...


def _as_axes(value: Any, *, where: str) -> MeshAxes:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AxisNameError(
        f"{where}: {value!r} is not a mesh axis; expected a mesh axis name, a tuple of names, or None."
    )


def mesh_axis_names(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True, init=False)
class Logical:
    """Map the logical axis names declared with `eqxpar.param` to mesh axes.

    Claims every leaf that carries logical axes (from any eqxpar layer, and the
    gradients and optimizer moments that mirror it); leaves without them are left to
    the next rule. Names missing from the mapping are not split. When two dimensions
    of one leaf map to the same mesh axis, the first keeps it and the later one is
    not split (a mesh axis can split only one dimension).

    **Arguments:**

    - `mapping`: logical name -> mesh axis name, tuple of names, or None.

    ```python
    rules = eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "embed": "fsdp"})
    ```
    """

    mapping: tuple[tuple[str, MeshAxes], ...]

    def __init__(self, mapping: Mapping[str, MeshAxes]):
        items = tuple((str(k), _as_axes(v, where=f"Logical rule {k!r}")) for k, v in dict(mapping).items())
        object.__setattr__(self, "mapping", items)

    def mesh_axes(self) -> set[str]:
        return {a for _, v in self.mapping for a in mesh_axis_names(v)}

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        if leaf.axes is None:
            return None
        table = dict(self.mapping)
        used: set[str] = set()
        entries: list[MeshAxes] = []
        for name in leaf.axes:
            target = table.get(name) if name is not None else None
            names = mesh_axis_names(target)
            if any(a in used for a in names):
                target = None
            else:
                used.update(names)
            entries.append(target)
        return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Shard every large-enough array over one mesh axis (works on any pytree).

    Splits the largest dimension that the axis size divides evenly (the first such
    dimension on a tie), never a stack dimension (layers of a scanned stack, which
    are used one at a time); arrays with fewer than `min_size` elements per stack
    entry, or with no divisible dimension, are replicated. Needs no metadata, so it shards plain
    Equinox models (`eqx.nn.MLP`) as well as eqxpar layers.

    **Arguments:**

    - `axis`: the mesh axis (or tuple of axes) to shard over. Default `"fsdp"`.
    - `min_size`: arrays with fewer elements stay replicated (biases, norms).

    ```python
    rules = eqxpar.rules.FSDP(axis="fsdp", min_size=2**12)
    ```
    """

    axis: str | tuple[str, ...] = "fsdp"
    min_size: int = 2**10

    def mesh_axes(self) -> set[str]:
        return set(mesh_axis_names(self.axis))

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        if leaf.mesh is None:
            raise AxisNameError(
                f"rules.FSDP(axis={self.axis!r}) needs the mesh to choose a divisible "
                "dimension; resolve it through a Plan (partition_specs(tree, plan))."
            )
        size = math.prod(leaf.mesh.shape[a] for a in mesh_axis_names(self.axis))
        if math.prod(leaf.shape[leaf.leading :]) < self.min_size:
            return PartitionSpec()
        candidates = [
            i for i, d in enumerate(leaf.shape) if i >= leaf.leading and d % size == 0 and d >= size
        ]
        if not candidates:
            return PartitionSpec()
        dim = max(candidates, key=lambda i: (leaf.shape[i], -i))
        entries: list[MeshAxes] = [None] * len(leaf.shape)
        entries[dim] = self.axis
        return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True, init=False)
class ByPath:
    """Give specs by regular expressions on leaf paths (works on any pytree).

    Each pattern is searched (`re.search`) in the leaf's path string, e.g.
    `".layers[1].weight"`, which also matches the optimizer moments of that weight
    (`"[0].mu.layers[1].weight"`); the first matching pattern gives the spec, in
    mesh axis names. Scalars are always replicated and never reach a rule.

    **Arguments:**

    - `patterns`: a sequence of `(regex, spec)`; `spec` is a `PartitionSpec` or a
      tuple of mesh axes.
    - `strict`: when True, a leaf no pattern matches raises `UnmatchedLeafError`
      naming its path; when False it is left to the next rule.

    ```python
    rules = eqxpar.rules.ByPath([(r"layers\\[\\d+\\]\\.weight$", P("tensor", None)),
                                 (r"bias$", P())], strict=True)
    ```
    """

    patterns: tuple[tuple[str, PartitionSpec], ...]
    strict: bool

    def __init__(self, patterns: Sequence[tuple[str, Any]], *, strict: bool = True):
        compiled = []
        for pattern, spec in patterns:
            re.compile(pattern)
            if not isinstance(spec, PartitionSpec):
                spec = PartitionSpec(*spec)
            compiled.append((pattern, spec))
        object.__setattr__(self, "patterns", tuple(compiled))
        object.__setattr__(self, "strict", strict)

    def mesh_axes(self) -> set[str]:
        return {a for _, spec in self.patterns for entry in spec for a in mesh_axis_names(entry)}

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        for pattern, spec in self.patterns:
            if re.search(pattern, leaf.path):
                return spec
        if self.strict:
            raise UnmatchedLeafError(
                f"no ByPath pattern matches the leaf at path {leaf.path!r} "
                f"(shape {leaf.shape}); patterns: {[p for p, _ in self.patterns]}. "
                "Add a pattern for it (e.g. (r'.*', P()) last to replicate the rest), "
                "or pass strict=False to leave unmatched leaves to the next rule."
            )
        return None


@dataclasses.dataclass(frozen=True)
class Policy:
    """A rule from a function `fn(leaf: Leaf) -> PartitionSpec | None`.

    The escape hatch for anything the other rules cannot say; `fn` sees the leaf's
    path, shape, dtype, logical axes and the mesh.

    ```python
    big_first_dim = eqxpar.rules.Policy(
        lambda leaf: P("fsdp") if leaf.shape[0] >= 1024 else None)
    ```
    """

    fn: Callable[[Leaf], PartitionSpec | None]

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        return self.fn(leaf)


def as_rules(rules: Any) -> tuple[Rule, ...]:
    """Normalise a rule, a sequence of rules, or None into a tuple of rules."""
    if rules is None:
        return ()
    if isinstance(rules, Rule):
        return (rules,)
    if isinstance(rules, Sequence) and not isinstance(rules, str):
        out = []
        for r in rules:
            out.extend(as_rules(r))
        return tuple(out)
    raise TypeError(
        f"{rules!r} is not a rule; expected an eqxpar.rules rule (Logical, FSDP, "
        "ByPath, Policy), a sequence of them, or None."
    )


@dataclasses.dataclass(frozen=True)
class ZeroShard:
    """Another rule set's specs, with one more dimension split over `axis`: the
    layout of ZeRO-1 optimizer state (`Plan(zero1=True)` uses it).

    The added split goes on the largest dimension the rule set leaves unsplit and
    that the axis size divides (never a stack dimension); leaves with fewer than
    `min_size` elements per stack entry, or with no such dimension, keep the base
    spec.

    **Arguments:**

    - `base`: the rules giving the parameters' specs (a rule or sequence).
    - `axis`: the mesh axis or axes to add (default `("data", "fsdp")`).
    - `min_size`: see `FSDP`.

    ```python
    opt_rules = eqxpar.rules.ZeroShard(eqxpar.rules.MEGATRON, axis=("data",))
    ```
    """

    base: Any
    axis: str | tuple[str, ...] = ("data", "fsdp")
    min_size: int = 2**10

    def mesh_axes(self) -> set[str]:
        out = set(mesh_axis_names(self.axis))
        for rule in as_rules(self.base):
            declared = getattr(rule, "mesh_axes", None)
            out |= set(declared() if declared else ())
        return out

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        spec = None
        for rule in as_rules(self.base):
            spec = rule.spec(leaf)
            if spec is not None:
                break
        entries: list[MeshAxes] = list(spec or PartitionSpec())
        entries += [None] * (len(leaf.shape) - len(entries))
        axes = tuple(a for a in mesh_axis_names(self.axis) if leaf.mesh is None or leaf.mesh.shape[a] > 1)
        used = {a for e in entries for a in mesh_axis_names(e)}
        if not axes or used & set(axes) or math.prod(leaf.shape[leaf.leading :]) < self.min_size:
            return PartitionSpec(*entries)
        size = math.prod(leaf.mesh.shape[a] for a in axes) if leaf.mesh is not None else 1
        free = [
            i
            for i, d in enumerate(leaf.shape)
            if i >= leaf.leading and entries[i] is None and d % size == 0 and d >= size
        ]
        if not free:
            return PartitionSpec(*entries)
        dim = max(free, key=lambda i: (leaf.shape[i], -i))
        entries[dim] = axes if len(axes) > 1 else axes[0]
        return PartitionSpec(*entries)
