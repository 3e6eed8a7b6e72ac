"""Rule kinds that map the leaves of a pytree to PartitionSpecs.

Give a plan one rule or a sequence (first match wins; unclaimed leaves are
replicated):

- `Logical(mapping)`: logical axis names declared with `eqxpar.param` -> mesh axes.
- `FSDP(axis=, min_size=)`: shard each large array's largest divisible dimension.
- `ByPath([(regex, spec), ...], strict=)`: specs by regular expression on leaf paths.
- `Policy(fn)`: any function of the leaf.

The last three need no metadata, so they also shard plain Equinox models.
"""

from ._rules import (
    FSDP as FSDP,
    ByPath as ByPath,
    Leaf as Leaf,
    Logical as Logical,
    Policy as Policy,
    Rule as Rule,
)
