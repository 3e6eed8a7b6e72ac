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

from ._errors import AxisNameError, PlanError, SpecError, UnmatchedLeafError
from ._text import short

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


def _as_split_axes(value: Any, *, where: str) -> str | tuple[str, ...]:
    """One mesh axis or a non-empty tuple of them (a list becomes a tuple, so the
    rule stays hashable); `where` names the argument in the error."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AxisNameError(
        f"{where}: {short(value)} is not a mesh axis to split over; expected a mesh axis "
        "name such as 'fsdp', or a non-empty tuple of names such as ('data', 'fsdp')."
    )


def _as_min_size(value: Any, *, where: str) -> int:
    # bool is an int subclass: min_size=True is a slip, not a size.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise PlanError(
        f"{where}: min_size={short(value)} is not an element count; expected a "
        "non-negative int (arrays with fewer elements stay replicated), e.g. min_size=1024."
    )


def as_spec(value: Any, *, where: str) -> PartitionSpec:
    """A `PartitionSpec`, or a tuple / list of spec entries (each a mesh axis name,
    a tuple of names, or None) turned into one; anything else raises `SpecError`
    (or `AxisNameError` for an entry that is not an axis name). `where` names the
    value in the error."""
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, str):
        # PartitionSpec(*"tensor") would split six dimensions over axes 't', 'e', ...
        raise SpecError(
            f"{where}: {value!r} is a bare string, not a PartitionSpec. Write "
            f"P({value!r}) to split the first dimension over {value!r}, or "
            f"P(None, {value!r}) for the second (P = jax.sharding.PartitionSpec)."
        )
    if isinstance(value, Sequence):
        return PartitionSpec(*(_as_axes(entry, where=where) for entry in value))
    raise SpecError(
        f"{where}: {short(value)} is not a PartitionSpec; expected a "
        "jax.sharding.PartitionSpec or a tuple of mesh axes per dimension. Use P() to "
        "replicate, or e.g. P('tensor', None) to split the first dimension."
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
    split over the rest of its axes, if any (a mesh axis can split only one
    dimension): with `{"experts": "expert", "embed": ("fsdp", "expert")}` an
    expert's `("experts", "embed", ...)` weight splits its model dimension over
    `fsdp` alone.

    **Arguments:**

    - `mapping`: logical name -> mesh axis name, tuple of names, or None.

    ```python
    rules = eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "embed": "fsdp"})
    ```
    """

    mapping: tuple[tuple[str, MeshAxes], ...]

    # `Any`, not `Mapping[str, MeshAxes]`: the checks below name the bad entry and
    # the fix, which a type checker's message would not.
    def __init__(self, mapping: Any):
        try:
            table = dict(mapping)
        except (TypeError, ValueError) as e:
            raise PlanError(
                f"rules.Logical({short(mapping)}): expected a mapping of logical axis names to "
                "mesh axes, e.g. rules.Logical({'mlp': 'tensor', 'embed': 'fsdp'})."
            ) from e
        for name in table:
            if not isinstance(name, str):
                raise PlanError(
                    f"rules.Logical: key {name!r} is not a logical axis name; expected the str "
                    "names layers declare with eqxpar.param(axes=...), e.g. 'mlp'."
                )
        items = tuple((k, _as_axes(v, where=f"Logical rule {k!r}")) for k, v in table.items())
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
            kept = tuple(a for a in names if a not in used)
            used.update(kept)
            if kept != names:
                target = None if not kept else kept[0] if len(kept) == 1 else kept
            entries.append(target)
        return PartitionSpec(*entries)


#: The dimensions `rules.FSDP(dim=...)` may split.
FSDP_DIMS = ("largest", "leading")


@dataclasses.dataclass(frozen=True, init=False)
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
    - `dim`: which divisible dimension: `"largest"` (default), or `"leading"`, the
      first one (after a stack's). A gradient reduce-scattered along a dimension
      the TPU compiler lays out minor-most (a fused MLP input weight
      `(d_model, 2, hidden)` split along `hidden`) can run as an all-reduce there,
      twice the wire bytes; split along `d_model` it is reduce-scattered. Only a
      manual step (a pipeline) fixes where each weight's gather and reduce-scatter
      run; under automatic FSDP the compiler re-lays the gradient itself.

    ```python
    rules = eqxpar.rules.FSDP(axis="fsdp", min_size=2**12)
    ```
    """

    axis: str | tuple[str, ...]
    min_size: int
    dim: str

    # Checked here, not by the annotations: FSDP(axis=1) raises naming the value.
    def __init__(self, axis: Any = "fsdp", min_size: Any = 2**10, dim: Any = "largest"):
        object.__setattr__(self, "axis", _as_split_axes(axis, where=f"rules.FSDP(axis={axis!r})"))
        object.__setattr__(self, "min_size", _as_min_size(min_size, where="rules.FSDP"))
        if dim not in FSDP_DIMS:
            raise PlanError(
                f"rules.FSDP(dim={short(dim)}): expected one of {FSDP_DIMS}: the largest divisible "
                "dimension, or the first one."
            )
        object.__setattr__(self, "dim", dim)

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
        dim = candidates[0] if self.dim == "leading" else max(candidates, key=lambda i: (leaf.shape[i], -i))
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

    # `Any` annotations: each check below names the bad pattern and the fix.
    def __init__(self, patterns: Any, *, strict: Any = True):
        if isinstance(patterns, Mapping):
            patterns = list(patterns.items())
        if isinstance(patterns, str | PartitionSpec) or not isinstance(patterns, Sequence):
            raise PlanError(
                f"rules.ByPath({short(patterns)}): expected a list of (regex, spec) pairs, "
                "e.g. rules.ByPath([(r'weight$', P(None, 'tensor'))])."
            )
        checked = tuple(_path_pattern(item, i) for i, item in enumerate(patterns))
        if not isinstance(strict, bool):
            raise PlanError(f"rules.ByPath(..., strict={short(strict)}): expected True or False.")
        object.__setattr__(self, "patterns", checked)
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


def _path_pattern(item: Any, index: int) -> tuple[str, PartitionSpec]:
    """Check one `(regex, spec)` entry of `ByPath`; `index` places it in the list."""
    where = f"rules.ByPath pattern #{index}"
    if isinstance(item, str) or not (isinstance(item, Sequence) and len(item) == 2):
        raise PlanError(
            f"{where} {short(item)} is not a (regex, spec) pair; expected a list of pairs "
            "(a single pair still goes in a list: rules.ByPath([(r'weight$', P())]))."
        )
    pattern, spec = item
    if not isinstance(pattern, str):
        raise PlanError(
            f"{where}: the regex {short(pattern)} is not a string; expected a regular "
            "expression searched in the leaf path, e.g. r'layers\\[0\\]\\.weight$'."
        )
    try:
        re.compile(pattern)
    except re.error as e:
        raise PlanError(
            f"{where}: {pattern!r} is not a valid regular expression ({e}). Escape the "
            "characters meant literally (r'\\[', r'\\.', or re.escape(text))."
        ) from e
    if spec is None:
        raise SpecError(
            f"{where} ({pattern!r}, None): None is not a PartitionSpec. Use P() to "
            "replicate the leaves it matches, or drop the pattern and pass strict=False "
            "to leave them to the next rule."
        )
    return pattern, as_spec(spec, where=f"{where} ({pattern!r}, spec)")


@dataclasses.dataclass(frozen=True, init=False)
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

    def __init__(self, fn: Any):
        if not callable(fn) or isinstance(fn, type):
            raise PlanError(
                f"rules.Policy({short(fn)}): expected a function of one eqxpar.rules.Leaf "
                "returning a PartitionSpec or None, e.g. rules.Policy(lambda leaf: P('fsdp') "
                "if leaf.shape[0] >= 1024 else None)."
            )
        object.__setattr__(self, "fn", fn)

    def spec(self, leaf: Leaf) -> PartitionSpec | None:
        found = self.fn(leaf)
        if found is None or isinstance(found, PartitionSpec):
            return found
        # The function runs once per leaf, so its mistakes surface here: name the leaf.
        return as_spec(found, where=f"rules.Policy({short(self.fn)}) for leaf {leaf.path!r} returned")


def as_rules(rules: Any) -> tuple[Rule, ...]:
    """Normalise a rule, a sequence of rules, or None into a tuple of rules."""
    if rules is None:
        return ()
    if isinstance(rules, type):
        # The class itself has a `spec` attribute, so it would pass as a Rule and
        # fail later with a missing-argument TypeError.
        raise PlanError(
            f"rules={rules.__name__} is a rule class, not a rule; pass an instance, "
            f"e.g. rules={rules.__name__}(...)."
        )
    if isinstance(rules, Rule):
        return (rules,)
    if isinstance(rules, Sequence) and not isinstance(rules, str):
        out = []
        for r in rules:
            out.extend(as_rules(r))
        return tuple(out)
    raise PlanError(
        f"rules={short(rules)} is not a rule; expected an eqxpar.rules rule (Logical, FSDP, "
        "ByPath, Policy, ZeroShard, or rules.MEGATRON), a list of them, or None."
    )


@dataclasses.dataclass(frozen=True, init=False)
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

    base: tuple[Rule, ...]
    axis: MeshAxes
    min_size: int

    def __init__(self, base: Any, axis: Any = ("data", "fsdp"), min_size: Any = 2**10):
        # Normalised to a tuple of rules: a list base would make the rule unhashable.
        object.__setattr__(self, "base", as_rules(base))
        # May name no axis: a plan without batch axes gives its optimizer state the base specs.
        object.__setattr__(self, "axis", _as_axes(axis, where=f"rules.ZeroShard(axis={axis!r})"))
        object.__setattr__(self, "min_size", _as_min_size(min_size, where="rules.ZeroShard"))

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
