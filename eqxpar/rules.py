"""Rule kinds that map the leaves of a pytree to PartitionSpecs.

Give a plan one rule or a sequence (first match wins; unclaimed leaves are
replicated):

- `Logical(mapping)`: logical axis names declared with `eqxpar.param` -> mesh axes.
- `FSDP(axis=, min_size=, dim=)`: shard each large array's largest (or first) divisible dimension.
- `ByPath([(regex, spec), ...], strict=)`: specs by regular expression on leaf paths.
- `Policy(fn)`: any function of the leaf.
- `ZeroShard(base, axis=)`: another rule set's specs plus a split over the
  data-parallel axes (the ZeRO-1 optimizer-state layout).

Ready-made: `EXPERT` (expert parallelism of `eqxpar.nn.MoE`), `MEGATRON` (tensor
parallelism of eqxpar.nn layers, experts over `expert` too), `MEGATRON_FSDP` and
`EXPERT_FSDP` (FSDP over `fsdp` and `expert` beside expert parallelism).

The last three need no metadata, so they also shard plain Equinox models.
"""

from ._rules import (
    FSDP as FSDP,
)
from ._rules import (
    ByPath as ByPath,
)
from ._rules import (
    Leaf as Leaf,
)
from ._rules import (
    Logical as Logical,
)
from ._rules import (
    Policy as Policy,
)
from ._rules import (
    Rule as Rule,
)
from ._rules import (
    ZeroShard as ZeroShard,
)

#: Expert parallelism: the experts of `eqxpar.nn.MoE` layers split over `expert`
#: (a no-op on a mesh whose `expert` axis has size 1); everything else replicated.
EXPERT = Logical({"experts": "expert"})

#: Megatron tensor parallelism for eqxpar.nn layers: MLP hidden features (the
#: experts' too), attention heads and the vocabulary split over `tensor`, the
#: experts of MoE layers over `expert`; everything else replicated.
MEGATRON = Logical(
    {"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor", "vocab": "tensor", "experts": "expert"}
)

#: `MEGATRON` plus FSDP: the model dimension of every weight split over `fsdp`.
MEGATRON_FSDP = Logical(
    {
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "vocab": "tensor",
        "experts": "expert",
        "embed": "fsdp",
    }
)

#: `MEGATRON_FSDP` with the model dimension split over `expert` too, as over
#: `fsdp` (as MaxText's `embed` rule lists its expert axis): beside expert
#: parallelism, the weights outside the experts (attention, embedding, head,
#: norms, routers) and their optimizer state are split over every batch-like
#: axis rather than replicated over `expert`, and gathered over both where used.
#: An expert's weight keeps `expert` for its experts and splits its model
#: dimension over `fsdp` alone (`Logical`: a mesh axis splits one dimension).
#: On a mesh without `fsdp` (size 1) those weights split over `expert` alone,
#: still gathered where used.
EXPERT_FSDP = Logical(
    {
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "vocab": "tensor",
        "experts": "expert",
        "embed": ("fsdp", "expert"),
    }
)
