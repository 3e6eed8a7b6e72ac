"""`compile_train_step`: a model's train step compiled from shapes for a plan's
mesh (a TPU topology this machine does not have, or its own devices), and what
the compiler says of it."""

import math
import re
import resource
import sys
import time
from collections import Counter
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._errors import PlanError
from .._plan import Plan
from .._slices import slice_factors
from ..inspect import CollectiveStats, OverlapStats, collective_stats, minimum_comm, overlap_stats
from ..internal import ResolvedPlan
from ..models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss, preset
from ..pipeline import PipelineLoss
from ..train import init, make_step
from ._report import AotReport

#: Memory of one device, by `jax.Device.device_kind`. v5p: the HBM the TPU
#: compiler says is available to a program (95.74 GiB in libtpu 0.0.42.1
#: out-of-memory message); the others: Cloud TPU's documented capacity (16 GB for
#: v5e, 32 GB for v6e and v4), which a program may not get all of.
DEVICE_MEMORY: dict[str, int] = {
    "TPU v5": int(95.74 * 2**30),
    "TPU v5p": int(95.74 * 2**30),
    "TPU v5 lite": 16 * 10**9,
    "TPU v5e": 16 * 10**9,
    "TPU v6 lite": 32 * 10**9,
    "TPU v6e": 32 * 10**9,
    "TPU v4": 32 * 10**9,
}


def _peak_rss() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _device_memory(device: Any) -> int | None:
    if device.platform == "cpu":
        return None
    return DEVICE_MEMORY.get(device.device_kind)


def _outline(model: Any) -> tuple[str, Any]:
    """`(name, outline)` of a preset name, a `GPTConfig`, or a model (or outline)."""
    if isinstance(model, str):
        model = preset(model)
    if isinstance(model, GPTConfig):
        return "GPT", eqx.filter_eval_shape(GPT, model, key=jax.random.key(0))
    return type(model).__name__, eqx.filter_eval_shape(lambda: model)


def _default_loss(outline: Any, pipelined: bool) -> Any:
    if not isinstance(outline, GPT):
        raise PlanError(
            f"compile_train_step(model={type(outline).__name__}, loss=None): only a GPT has a default loss "
            "(eqxpar.models.lm_loss). Pass loss=your_loss_fn(model, batch)."
        )
    if pipelined:
        return PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)
    return lm_loss


def compile_train_step(
    model: Any,
    # Any: checked below, with an eqxpar error that names the value.
    plan: Any,
    *,
    batch: Any,
    optimizer: optax.GradientTransformation | None = None,
    loss: Any = None,
    name: str | None = None,
    minimum: bool = True,
) -> AotReport:
    """Compile `model`'s train step under `plan` from shapes, for the plan's mesh,
    and report what the compiler says of it. Nothing is allocated: the model, the
    optimizer state and the batch are outlines (`train.init(..., abstract=True)`).

    With a mesh over a TPU topology (`eqxpar.make_mesh(..., topology="v5p-64")`,
    needs libtpu) this is the program that slice would run, compiled on this
    machine: its memory per chip, its collectives and their schedule are the
    TPU compiler's. GPU topologies cannot be compiled this way (JAX describes
    only TPU slices that are not attached). Under FSDP x tensor with an FSDP
    group of at most 8 chips it compiles with libtpu's windowed gradient
    scatters off (`--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false`,
    fewer wire bytes and temporaries there), as the step itself does on
    attached chips: the option is in its `jax.jit`.

    **Arguments:**

    - `model`: a preset name (`"llama3-8b"`, see `eqxpar.models.PRESET_NAMES`), a
      `GPTConfig`, or any model (arrays or outlines) with `loss`.
    - `plan`: the plan; its mesh says where to compile.
    - `batch`: `(rows per chip, sequence length)`, as MaxText's
      `per_device_batch_size`: the step's batch is `rows x chips` sequences of
      `length + 1` token ids (inputs and shifted targets), split over the plan's
      batch axes.
    - `optimizer`: default `optax.adamw(1e-4)` (float32 moments).
    - `loss`: default `eqxpar.models.lm_loss` (a pipeline's `PipelineLoss` of
      `gpt_first` / `gpt_last` under a pipelined plan).
    - `name`: the model's name in the report (default the preset's, or its class).
    - `minimum`: compare the collectives with `eqxpar.inspect.minimum_comm`
      (default True).

    **Returns:** an `AotReport`; `print(report)` gives the table `python -m
    eqxpar.aot` prints.

    ```python
    mesh = eqxpar.make_mesh(fsdp=32, topology="v5p-64")
    plan = eqxpar.Plan(mesh, rules=eqxpar.rules.FSDP(), remat="full", compute_dtype=jnp.bfloat16)
    report = eqxpar.aot.compile_train_step("llama3-8b", plan, batch=(1, 2048))
    print(report)
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"compile_train_step(plan={plan!r}): expected an eqxpar.Plan.")
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(_positive(n) for n in batch)):
        raise PlanError(
            f"compile_train_step(batch={batch!r}): expected (rows per chip, sequence length), two positive "
            "integers, e.g. (1, 2048)."
        )
    label = name or (model if isinstance(model, str) else None)
    kind, outline = _outline(model)
    dims = ResolvedPlan.of(plan).dims
    loss = _default_loss(outline, dims.schedule is not None) if loss is None else loss
    optimizer = optax.adamw(1e-4) if optimizer is None else optimizer
    mesh = plan.mesh
    chips = math.prod(mesh.devices.shape)
    rows, length = batch
    tokens = jax.ShapeDtypeStruct((rows * chips, length + 1), jnp.int32)
    state = init(outline, optimizer, plan, key=jax.random.key(0), abstract=True)
    start = time.perf_counter()
    lowered = make_step(loss, optimizer, plan).lower(state, tokens)
    lowered_at = time.perf_counter()
    device = mesh.devices.flat[0]
    # The step's jit carries the compiler options eqxpar picks for the plan on TPU
    # (`_tpu_compiler`), so this is the program the step runs on attached chips.
    compiled, refusal = _compiled_or_refusal(lowered)
    compiled_at = time.perf_counter()
    least = minimum_comm(plan, state.model, loss=loss, batch=tokens) if minimum else None
    common = dict(
        **_slices_of(mesh),
        model=label or kind,
        topology=getattr(device, "device_kind", device.platform),
        chips=chips,
        mesh={str(a): int(mesh.shape[a]) for a in mesh.axis_names},
        plan=_describe(dims),
        tokens_per_step=rows * chips * length,
        minimum=least,
        minimum_note="not asked for" if least is None else least.note,
        lower_seconds=lowered_at - start,
        compile_seconds=compiled_at - lowered_at,
        peak_rss_bytes=_peak_rss(),
    )
    if compiled is None:
        return _refused(common, refusal, sum(_shard_bytes(x) for x in jax.tree.leaves((state, tokens))))
    memory = compiled.memory_analysis()
    return AotReport(
        **common,
        **_groups_of(compiled.as_text()),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        **_host_memory(memory),
        heap_temp_bytes=_heap_temp(memory),
        compiler_peak_bytes=_optional_int(getattr(memory, "peak_memory_in_bytes", None)),
        memory_per_chip=_device_memory(device),
        collectives=collective_stats(compiled, mesh=mesh),
        overlap=overlap_stats(compiled),
        cost=_cost(compiled),
    )


def _refused(common: dict[str, Any], refusal: Exception, argument_bytes: int) -> AotReport:
    """The report of a plan the compiler refused before laying out its buffers:
    what it says it needed and had, and the arguments' shards (outputs alias them)."""
    needed, available = _out_of_memory(refusal)
    return AotReport(
        **common,
        argument_bytes=argument_bytes,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=needed,
        code_bytes=0,
        memory_per_chip=available,
        collectives=CollectiveStats(count=Counter(), bytes=Counter()),
        overlap=OverlapStats(async_wire_bytes=0, wire_bytes=0, by_kind={}),
        cost={},
        refused=str(refusal).splitlines()[0][:300],
    )


def _host_memory(memory: Any) -> dict[str, int]:
    """`memory_analysis()`'s host memory figures (what `Plan(offload=...)` moves
    there) as `AotReport` fields; 0 where a backend has none."""
    return {
        f"host_{part}_bytes": int(getattr(memory, f"host_{part}_size_in_bytes", 0))
        for part in ("argument", "output", "alias", "temp")
    }


def _heap_temp(memory: Any) -> int | None:
    """The device temporaries as the buffer assignment lays them out: all it
    allocates less the arguments' and outputs' buffers (`AotReport.heap_temp_bytes`);
    None where the installed jaxlib's `memory_analysis()` does not give them."""
    total = getattr(memory, "total_allocation_bytes", None)
    held = getattr(memory, "indefinite_allocations", None)
    return None if total is None or held is None else int(total) - int(held)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


_FIRST_GROUP = re.compile(r"replica_groups=\{\{([\d,]+)\}")
_DCN_TARGET = re.compile(r'_xla_megascale_target=("\{[^"]*"|\{\{[\d,]{0,60})')


def _slices_of(mesh: Any) -> dict[str, Any]:
    """The report's `slices` and `dcn` of a mesh."""
    factors = dict(zip(mesh.axis_names, slice_factors(mesh.devices), strict=True))
    return dict(slices=math.prod(factors.values()), dcn={str(a): n for a, n in factors.items() if n > 1})


def _groups_of(text: str) -> dict[str, tuple[str, ...]]:
    """The report's `replica_groups` and `dcn_targets` of compiled HLO `text`."""
    return dict(replica_groups=_first_groups(text), dcn_targets=tuple(sorted(set(_DCN_TARGET.findall(text)))))


def _first_groups(text: str) -> tuple[str, ...]:
    """The distinct first replica groups written in `text`, a run of ids as `a-b`."""
    seen = set()
    for ids in _FIRST_GROUP.findall(text):
        members = [int(i) for i in ids.split(",") if i]
        run = members == list(range(members[0], members[0] + len(members))) if members else False
        seen.add(f"{{{members[0]}-{members[-1]}}}" if run and len(members) > 2 else f"{{{ids}}}")
    return tuple(sorted(seen))


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _compiled_or_refusal(lowered: Any) -> tuple[Any, Exception | None]:
    """`(compiled, None)`, or `(None, error)` where the TPU compiler refused the
    program for memory (its out-of-memory error); any other error is raised."""
    try:
        return lowered.compile(), None
    except Exception as error:  # noqa: BLE001 - the TPU compiler's out-of-memory is a JaxRuntimeError
        if _out_of_memory(error) is None:
            raise
        return None, error


_HBM_OOM = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def _out_of_memory(error: Any) -> tuple[int, int] | None:
    """`(temporary bytes needed, bytes available)` from the TPU compiler's
    out-of-memory refusal (`CompileTimeHbmOom`, sizes in GiB), else None."""
    m = _HBM_OOM.search(str(error))
    if m is None:
        return None
    return int(float(m.group(1)) * 2**30), int(float(m.group(2)) * 2**30)


def _shard_bytes(x: Any) -> int:
    """One device's bytes of an outline with a sharding (the whole array without one)."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


def _cost(compiled: Any) -> dict[str, float]:
    """`cost_analysis()`'s flops and bytes accessed, where the backend gives them."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without one raises its own error kinds
        return {}
    if isinstance(cost, list):  # jax before 0.4.30 gave one dict per program
        cost = cost[0] if cost else {}
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in (cost or {})}


def _describe(dims: Any) -> str:
    """One line naming what the plan chose (`dims`: its `ParallelDims`)."""
    parts = [f"mode={dims.mode or 'auto'}", f"remat={dims.remat}"]
    if dims.compute_dtype is not None:
        parts.append(f"compute={jnp.dtype(dims.compute_dtype).name}")
    if dims.param_dtype is not None:
        parts.append(f"params={jnp.dtype(dims.param_dtype).name}")
    if dims.schedule is not None:
        parts.append(f"schedule={dims.schedule} x{dims.microbatches}")
    return "plan(" + ", ".join(parts) + ")"
