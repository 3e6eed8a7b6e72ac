"""The plans eqxpar can run for a device count: mesh sizes and plan options."""

import dataclasses
from collections.abc import Iterator
from typing import Any

from .. import rules as _rules

#: Tensor parallelism over eqxpar layers' heads and MLP features, the
#: vocabulary whole (splitting a small vocabulary costs more traffic than it saves).
TENSOR = _rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"})
#: `TENSOR` plus the model dimension over `fsdp`.
TENSOR_FSDP = _rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor", "embed": "fsdp"})


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate before prediction: a family name, mesh sizes, `Plan` options."""

    family: str
    mesh: dict[str, int]
    options: dict[str, Any]

    @property
    def name(self) -> str:
        sizes = " x ".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 device"
        return f"{self.family}: {sizes}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(n: int, *, tensor: bool, pipeline: bool, context: bool, expert: bool) -> Iterator[Layout]:
    """Every family for `n` devices the model allows (`tensor`: it has eqxpar
    layers with heads / MLP features; `pipeline`: a `PipelineLoss` was given;
    `context`: it has attention; `expert`: it has MoE layers). Sizes that do not
    divide the model or batch are left for the caller to reject."""
    fsdp = _rules.FSDP(axis="fsdp")
    yield Layout("data parallel", {"data": n}, {})
    if n > 1:
        yield Layout("ZeRO-1", {"data": n}, {"zero1": True})
        yield Layout("FSDP", {"fsdp": n}, {"rules": fsdp, "mode": "manual"})
    for d in _divisors(n)[1:-1]:
        yield Layout("HSDP", {"data": d, "fsdp": n // d}, {"rules": fsdp, "mode": "manual"})
    for t in _divisors(n)[1:] if tensor else []:
        sp = {"mode": "manual", "sequence_parallel": True}
        yield Layout("tensor + sequence parallel", {"data": n // t, "tensor": t}, {"rules": TENSOR, **sp})
        for f in _divisors(n // t)[1:]:
            sizes = {"data": n // t // f, "fsdp": f, "tensor": t}
            yield Layout("FSDP x tensor (SP)", sizes, {"rules": TENSOR_FSDP, **sp})
    for p in _divisors(n)[1:] if pipeline else []:
        from ..pipeline import stage_rules

        for t in _divisors(n // p) if tensor else [1]:
            options = {"rules": stage_rules(TENSOR if t > 1 else None), "schedule": "1f1b"}
            sizes = {"data": n // p // t, "pipe": p, "tensor": t}
            yield Layout("pipeline 1F1B", sizes, {**options, "microbatches": 4 * p})
    for c in _divisors(n)[1:] if context else []:
        yield Layout("context (ring)", {"data": n // c, "context": c}, {"mode": "manual"})
        # Skipped (the heads' check names why) where c does not divide the heads.
        ulysses = {"mode": "manual", "context_attention": "ulysses"}
        yield Layout("context (ulysses)", {"data": n // c, "context": c}, ulysses)
    for e in _divisors(n)[1:] if expert else []:
        yield Layout("expert", {"data": n // e, "expert": e}, {"rules": _rules.EXPERT})
