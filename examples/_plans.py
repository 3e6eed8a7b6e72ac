"""Every plan the examples train under, in one table: name -> mesh and `Plan` keywords,
with the example that trains under it and the flags that choose it there.

The examples build their plans from this table (their flags pick a name, and add
what is orthogonal to it: remat, bfloat16, the pipeline schedule), and
tests/test_examples.py runs every entry. A name is `family/variant`:

- `data/*`: data parallel over every device (`data_parallel.py --mode`).
- `tensor/*`: data 2 x tensor 4, `rules.MEGATRON`, in each tensor-parallel mode
  (`tensor_parallel.py --mode`).
- `fsdp/*`: FSDP over fsdp=8, ZeRO-1 over data=8, HSDP over data 2 x fsdp 4
  (`fsdp.py`, `--zero1`, `--hsdp`; `--mode auto|manual` on top).
- `hybrid/*`: data 2 x fsdp 2 x tensor 2, `rules.MEGATRON_FSDP` (`hybrid.py --mode`).
- `pipeline/*`: the layers over `pipe`, the other devices over data or fsdp, with
  or without tensor 2 (`pipeline_parallel.py [--hybrid] [--fsdp]`, `hybrid_3d.py`).
- `context/*`: the sequence split over `context`: 4 x data 2 with ring attention,
  8 with all-gathered keys and values, data 2 x context 2 x tensor 2 with
  sequence parallelism (`long_context.py --mode`).
- `demo/*`: `demo.py`'s default 3D plan, and its plan without a pipeline.
- `vit/*`: data 4 x tensor 2, `rules.MEGATRON`, automatic or manual with sequence
  parallelism, for the Vision Transformer (`vision_transformer.py --mode`).
"""

import dataclasses
from typing import Any

import eqxpar

# Pipeline rules: the stacked layers over `pipe`; MEGATRON splits nothing more
# without `tensor`; MEGATRON_FSDP also splits the model dimension over `fsdp`
# (gathered once per step, gradients reduce-scattered).
_PIPE = eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON)
_PIPE_FSDP = eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON_FSDP)

#: FSDP: the model dimension ("embed") of every eqxpar.nn weight over `fsdp`; then,
#: for arrays without logical axes, the largest dimension that `fsdp` divides, if
#: the array has at least 1024 elements (small ones stay whole on every device).
FSDP_RULES = (eqxpar.rules.Logical({"embed": "fsdp"}), eqxpar.rules.FSDP(min_size=1024))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One named plan.

    **Fields:** `script` (the example that trains under it), `flags` (its flags that
    choose it), `mesh` (axis sizes for `eqxpar.make_mesh`, `-1` for the rest of the
    devices) and `options` (the `eqxpar.Plan` keywords).
    """

    script: str
    flags: tuple[str, ...]
    mesh: dict[str, int]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def plan(self, *, mesh: dict[str, int] | None = None, **options: Any) -> eqxpar.Plan:
        """The plan, with `mesh` sizes and `options` (Plan keywords) replacing the entry's."""
        return eqxpar.Plan(eqxpar.make_mesh(**{**self.mesh, **(mesh or {})}), **{**self.options, **options})


def _tensor(flag: str, **options: Any) -> Entry:
    return Entry(
        "tensor_parallel.py",
        ("--mode", flag),
        dict(data=2, tensor=4),
        dict(rules=eqxpar.rules.MEGATRON, **options),
    )


def _hybrid(flag: str, **options: Any) -> Entry:
    mesh = dict(data=2, fsdp=2, tensor=2)
    return Entry("hybrid.py", ("--mode", flag), mesh, dict(rules=eqxpar.rules.MEGATRON_FSDP, **options))


def _pipeline(script: str, flags: tuple[str, ...], mesh: dict[str, int], rules: Any) -> Entry:
    # The script's default schedule and micro-batches (hybrid_3d.py: 4, pipeline_parallel.py: 8).
    microbatches = 4 if script == "hybrid_3d.py" else 8
    return Entry(script, flags, mesh, dict(rules=rules, schedule="1f1b", microbatches=microbatches))


PLANS: dict[str, Entry] = {
    "data/auto": Entry("data_parallel.py", (), dict(data=-1)),
    "data/manual": Entry("data_parallel.py", ("--mode", "manual"), dict(data=-1), dict(mode="manual")),
    "tensor/auto": _tensor("auto"),
    # Manual: an all-reduce after each row-parallel layer ...
    "tensor/sync": _tensor("sync", mode="manual"),
    # ... or all-gathers and reduce-scatters around sequence-split activations ...
    "tensor/sp": _tensor("sp", mode="manual", sequence_parallel=True),
    # ... run as ring collective matmuls (collective-permutes) ...
    "tensor/overlap": _tensor("overlap", mode="manual", sequence_parallel=True, tp_overlap=True),
    # ... or with only `tensor` manual: `data` is the compiler's.
    "tensor/partial": _tensor("partial", mode="manual", manual_axes=("tensor",), sequence_parallel=True),
    "fsdp/fsdp": Entry("fsdp.py", (), dict(fsdp=8), dict(rules=FSDP_RULES)),
    # Parameters replicated (no rules), the optimizer state split over `data`.
    "fsdp/zero1": Entry("fsdp.py", ("--zero1",), dict(data=8), dict(zero1=True)),
    # Sharded in groups of 4, replicated across the 2 groups.
    "fsdp/hsdp": Entry("fsdp.py", ("--hsdp",), dict(data=2, fsdp=4), dict(rules=FSDP_RULES)),
    "hybrid/auto": _hybrid("auto"),
    "hybrid/manual": _hybrid("manual", mode="manual"),
    "hybrid/partial": _hybrid("partial", mode="manual", manual_axes=("tensor",)),
    # Pipelines: `--schedule`, `--microbatches`, `--chunks` and `--stages` change them.
    "pipeline/data": _pipeline("pipeline_parallel.py", (), dict(pipe=4, data=-1), _PIPE),
    "pipeline/fsdp": _pipeline("pipeline_parallel.py", ("--fsdp",), dict(pipe=4, fsdp=-1), _PIPE_FSDP),
    "pipeline/hybrid": _pipeline("hybrid_3d.py", (), dict(pipe=2, tensor=2, data=-1), _PIPE),
    "pipeline/hybrid-fsdp": _pipeline(
        "hybrid_3d.py", ("--fsdp",), dict(pipe=2, tensor=2, fsdp=-1), _PIPE_FSDP
    ),
    "context/ring": Entry("long_context.py", (), dict(data=2, context=4), dict(mode="manual")),
    "context/allgather": Entry(
        "long_context.py",
        ("--mode", "allgather"),
        dict(context=8),
        dict(mode="manual", context_attention="allgather"),
    ),
    "context/tensor": Entry(
        "long_context.py",
        ("--mode", "tensor"),
        dict(data=2, context=2, tensor=2),
        dict(rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True),
    ),
    "demo/3d": Entry(
        "demo.py",
        (),
        dict(data=2, pipe=2, tensor=2),
        dict(rules=_PIPE_FSDP, schedule="1f1b", microbatches=4, remat="dots"),
    ),
    # The same plan as hybrid/auto, for the demo's GPT.
    "demo/no-pipeline": Entry(
        "demo.py",
        ("--pipe", "1", "--fsdp", "2", "--remat", "none"),
        dict(data=2, fsdp=2, tensor=2),
        dict(rules=eqxpar.rules.MEGATRON_FSDP),
    ),
    # A non-causal encoder with pooling: heads and MLP features over tensor 2 (the
    # 16 patch tokens split over it under sequence parallelism), the batch over data 4.
    "vit/auto": Entry("vision_transformer.py", (), dict(data=4, tensor=2), dict(rules=eqxpar.rules.MEGATRON)),
    "vit/sp": Entry(
        "vision_transformer.py",
        ("--mode", "sp"),
        dict(data=4, tensor=2),
        dict(rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True),
    ),
}


def variants(family: str) -> list[str]:
    """The variants of `family` (`"tensor"` -> `["auto", "sync", ...]`), for a flag's choices."""
    return [name.split("/")[1] for name in PLANS if name.startswith(family + "/")]
