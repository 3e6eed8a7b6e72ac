"""`eqxpar.advise`: enumerate the plans for a device count, predict each, rank them."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._batch_layout import BatchLayout
from .._errors import EqxparError, PlanError
from .._mesh import CONTEXT_AXIS, make_mesh, mesh_platform
from .._parallel_dims import ParallelDims
from .._plan import Plan
from .._specs import is_array_like
from .._text import fmt_int, render, short
from .._train._resolved_plan import ResolvedPlan
from .._train._step_layout import StepLayout
from ._analysis import Analysis, analyse, outline
from ._enumerate import TENSOR, Layout, layouts
from ._predict import Prediction, _tensor_dims, placeholder_mesh, predict
from ._profile import DeviceProfile, as_profile

#: Compiler options for a step compiled only to read its memory and HLO: buffer
#: assignment runs before LLVM, so skipping LLVM's optimisations changes no byte.
_MEMORY_ONLY = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan the advisor considered: its `layout` (family, mesh sizes, `Plan`
    options), its `prediction`, and whether it `fits` the memory budget.

    ```python
    c = advice.candidates[0]
    c.name, c.mesh, c.prediction.memory_bytes
    ```
    """

    layout: Layout
    prediction: Prediction
    fits: bool

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def mesh(self) -> dict[str, int]:
        return self.layout.mesh


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A compiled candidate's measured bytes per device beside the prediction:
    `(predicted, measured)` for `argument_bytes`, `temp_bytes` and `wire_bytes`
    (all kinds); `errors` as predicted / measured - 1."""

    name: str
    argument_bytes: tuple[int, int]
    temp_bytes: tuple[int, int]
    wire_bytes: tuple[int, int]

    @property
    def errors(self) -> dict[str, float]:
        pairs = {"argument": self.argument_bytes, "temp": self.temp_bytes, "wire": self.wire_bytes}
        return {k: (p / m - 1.0 if m else float(p != 0)) for k, (p, m) in pairs.items()}


@dataclasses.dataclass(frozen=True)
class Advice:
    """The advisor's answer: `candidates` that fit the budget, fastest predicted
    first; `rejected` ones over it (least memory first); `skipped`: layouts the
    model or batch does not allow, with the reason. `str(advice)` is a table.

    ```python
    advice = eqxpar.advise(model, loss_fn, optim, batch, devices=8, memory_per_device=2**30, device="cpu")
    print(advice)
    plan = advice.plan(0)          # a ready eqxpar.Plan on a real mesh
    advice.check(2)                # compile the top two, measured beside predicted
    ```
    """

    candidates: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    skipped: tuple[tuple[str, str], ...]
    devices: int
    memory_per_device: int
    profile: DeviceProfile
    model: Any = dataclasses.field(repr=False)
    loss_fn: Callable = dataclasses.field(repr=False)
    optimizer: Any = dataclasses.field(repr=False)
    batch: Any = dataclasses.field(repr=False)
    pipeline_loss: Any = dataclasses.field(repr=False)

    def table(self, *, rejected: bool = True) -> str:
        """Plain-text table: rank, plan, memory (arguments + temporaries), wire
        bytes, predicted step time; then the rejected plans."""
        header = ["#", "plan", "memory/dev", "args", "temp", "wire/dev", "step (pred.)", "fits"]
        rows = []
        shown = list(self.candidates) + (list(self.rejected) if rejected else [])
        for i, c in enumerate(shown):
            p = c.prediction
            rows.append(
                [
                    str(i) if c.fits else "-",
                    c.name,
                    fmt_int(p.memory_bytes),
                    fmt_int(p.argument_bytes),
                    fmt_int(p.temp_bytes),
                    fmt_int(p.total_wire_bytes),
                    f"{p.step_time_s * 1e3:.3g} ms",
                    "yes" if c.fits else "no",
                ]
            )
        title = (
            f"plans for {self.devices} devices ({self.profile.name}), budget "
            f"{fmt_int(self.memory_per_device)} bytes per device; predicted, not compiled\n"
        )
        right = [True, False, True, True, True, True, True, False]
        return title + render(header, rows, right=right)

    def __str__(self) -> str:
        return self.table()

    def plan(self, i: int = 0, *, topology: Any = None) -> Plan:
        """The `i`-th ranked candidate as a `Plan` on a real mesh (`make_mesh`):
        this machine's devices, or with `topology` a TPU slice's (a name such as
        `"v5p-64"`, as `make_mesh` takes it; needs libtpu). A pipeline plan runs
        `pipeline_loss` (`eqxpar.pipeline.PipelineLoss`)."""
        if not isinstance(i, int) or not 0 <= i < len(self.candidates):
            raise PlanError(
                f"Advice.plan({i!r}): {len(self.candidates)} candidates fit the budget; expected an index "
                f"in range({len(self.candidates)}). Raise memory_per_device if none fit."
            )
        layout = self.candidates[i].layout
        return Plan(make_mesh(**layout.mesh, topology=topology), **layout.options)

    def check(self, k: int = 3, *, topology: Any = None) -> tuple[Comparison, ...]:
        """Compile (never run) the top `k` candidates' steps from shapes, one at a
        time, and put the compiler's memory analysis and the compiled HLO's wire
        bytes beside the predictions (`compare` for each). With `topology` (a TPU
        slice's name, e.g. `"v5p-256"`; needs libtpu) they compile for that slice,
        whatever this machine has: the TPU compiler's figures, at the scale the
        advice is for. Without it, for this machine's devices."""
        if not isinstance(k, int) or k < 1:
            raise PlanError(f"Advice.check(k={k!r}): expected a positive number of candidates.")
        return tuple(self.compare(i, topology=topology) for i in range(min(k, len(self.candidates))))

    def compare(self, i: int = 0, *, topology: Any = None) -> Comparison:
        """Compile (never run) the `i`-th ranked candidate's step from shapes (the
        model's outline and the optimizer state's, nothing allocated) and put its
        measured bytes per device beside the prediction: the compiler's
        `memory_analysis()` and the compiled HLO's wire bytes (a loop's
        collectives once per trip). For `topology`, see `check`. On this
        machine's CPU devices the step compiles without LLVM's optimisations,
        which run after buffer assignment and change no byte."""
        from .. import train
        from ..inspect import collective_stats, memory_report

        if topology is None and self.devices > jax.device_count():
            raise PlanError(
                f"Advice.check: the plans are for {self.devices} devices and this process has "
                f"{jax.device_count()}. Compile them for a TPU slice of that size with "
                "check(k, topology=...) (e.g. topology='v5p-64' for 32 chips), or where the devices exist."
            )
        plan, c = self.plan(i, topology=topology), self.candidates[i]
        loss = self.pipeline_loss if BatchLayout.of(plan).pipelined else self.loss_fn
        batch = outline(self.batch)
        state = train.init(outline(self.model), self.optimizer, plan, key=jax.random.key(0), abstract=True)
        step = train.make_step(loss, self.optimizer, plan)
        on_cpu = mesh_platform(plan.mesh) == "cpu"
        # On TPU the step's jit carries the options it runs with (`_tpu_compiler`).
        compiled = step.lower(state, batch).compile(compiler_options=_MEMORY_ONLY if on_cpu else None)
        memory, stats, p = memory_report(compiled), collective_stats(compiled), c.prediction
        return Comparison(
            name=c.name,
            argument_bytes=(p.argument_bytes, memory.argument_bytes),
            temp_bytes=(p.temp_bytes, memory.temp_bytes),
            wire_bytes=(p.total_wire_bytes, stats.total_wire_bytes),
        )


def _has(model: Any, kind: str) -> bool:
    from ..nn._attention import Attention
    from ..nn._moe import MoE

    cls = {"attention": Attention, "moe": MoE}[kind]
    return any(isinstance(x, cls) for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, cls)))


def advise(
    model: PyTree,
    loss_fn: Callable,
    optimizer: Any,
    batch: PyTree,
    *,
    devices: int,
    memory_per_device: int | None = None,
    device: Any = "h100",
    pipeline_loss: Any = None,
    slices: int | None = None,
) -> Advice:
    """Enumerate the plans eqxpar runs on `devices` devices, predict each one's
    memory, wire bytes and step time from shapes (nothing compiles), drop those
    over the memory budget and rank the rest by predicted step time.

    Families: data parallel, ZeRO-1, FSDP, HSDP; with eqxpar tensor-parallel
    layers tensor + sequence parallel and FSDP x tensor; with `pipeline_loss` 1F1B
    pipelines (x tensor); with attention context parallelism (ring, and Ulysses
    where the context size divides the heads); with MoE
    layers expert parallelism. Sizes the model's dimensions or the batch do not
    divide are skipped (`Advice.skipped`), as are sequence-parallel plans for a
    model with MoE layers (the layer refuses them). Device counts above this machine's are
    predicted on placeholder meshes (shapes only; `plan(i)` and `check` need the
    devices).

    **Arguments:**

    - `model`, `loss_fn`, `optimizer`, `batch`: what `eqxpar.train.make_step`
      takes (a global batch; arrays or `jax.ShapeDtypeStruct`s; the model may be
      its `eqx.filter_eval_shape` outline, except for `check`).
    - `devices`: the device count to plan for.
    - `memory_per_device`: the budget in bytes (default: the profile's memory).
    - `device`: a `DeviceProfile` or a name in `eqxpar.DEVICE_PROFILES`
      (`"h100"`, `"tpu_v5p"`, `"cpu"`).
    - `pipeline_loss`: an `eqxpar.pipeline.PipelineLoss` computing `loss_fn`, to
      include pipeline plans.
    - `slices`: the devices are this many slices joined by the data-centre
      network (TPU multislice, e.g. 2 x v5p-64): a collective whose group spans
      slices is charged the profile's `dcn_bytes_per_s` (default: the profile's
      own `devices_per_slice`, None for one slice). The outermost axes cross
      slices, as `make_mesh(dcn=...)` lays them: HSDP's `data`, all of FSDP's
      `fsdp`.

    **Returns:** an `Advice`.

    **Raises:** `PlanError` for a bad count, budget or device, or a loss that
    does not trace on the model and batch.

    ```python
    advice = eqxpar.advise(model, lm_loss, optax.adamw(1e-3), tokens, devices=8,
                           memory_per_device=2 * 2**30, device="h100")
    print(advice); plan = advice.plan(0)
    ```
    """
    profile, budget = _checked(devices, device, memory_per_device, pipeline_loss)
    profile = _sliced(profile, devices, slices)
    shapes = outline(model)
    params = eqx.filter(shapes, lambda x: is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact))
    if not jax.tree.leaves(params):
        raise PlanError("advise(model=...): the model has no floating-point arrays to train.")
    opt_state = eqx.filter_eval_shape(optimizer.init, params)
    tokens = outline(batch)
    analysis = analyse(shapes, loss_fn, tokens)
    staged = analyse(shapes, pipeline_loss, tokens) if pipeline_loss is not None else None
    probe = Plan(placeholder_mesh({"tensor": 2}), rules=TENSOR)
    probed = StepLayout.of(ResolvedPlan.of(probe), params).params
    tensor = bool(_tensor_dims(params, probed, ParallelDims.of(probe).tensor_axis))
    fitting, over, skipped = [], [], []
    moe = _has(shapes, "moe")
    for layout in layouts(
        devices,
        tensor=tensor,
        pipeline=pipeline_loss is not None,
        context=_has(shapes, "attention") and analysis.seq_len is not None,
        expert=moe,
    ):
        try:
            prediction = _predict_layout(
                layout, moe, shapes, opt_state, tokens, (loss_fn, analysis), (pipeline_loss, staged), profile
            )
        except EqxparError as e:
            skipped.append((layout.name, short(str(e))))
            continue
        candidate = Candidate(layout, prediction, prediction.memory_bytes <= budget)
        (fitting if candidate.fits else over).append(candidate)
    fitting.sort(key=lambda c: (c.prediction.step_time_s, c.prediction.memory_bytes))
    over.sort(key=lambda c: c.prediction.memory_bytes)
    return Advice(
        candidates=tuple(fitting),
        rejected=tuple(over),
        skipped=tuple(skipped),
        devices=devices,
        memory_per_device=budget,
        profile=profile,
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        batch=batch,
        pipeline_loss=pipeline_loss,
    )


def _checked(
    devices: Any, device: Any, memory_per_device: Any, pipeline_loss: Any
) -> tuple[DeviceProfile, int]:
    """`(device profile, memory budget per device)` of `advise`'s arguments, checked."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise PlanError(f"advise(devices={devices!r}): expected a positive device count, e.g. devices=8.")
    profile = as_profile(device)
    budget = profile.memory_bytes if memory_per_device is None else memory_per_device
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise PlanError(
            f"advise(memory_per_device={memory_per_device!r}): expected a positive number of bytes, "
            "e.g. 16 * 2**30."
        )
    if pipeline_loss is not None:
        from ..pipeline import PipelineLoss

        if not isinstance(pipeline_loss, PipelineLoss):
            raise PlanError(
                f"advise(pipeline_loss={pipeline_loss!r}): expected an eqxpar.pipeline.PipelineLoss "
                "(or None for no pipeline plans)."
            )
    return profile, budget


def _sliced(profile: DeviceProfile, devices: int, slices: Any) -> DeviceProfile:
    """`profile` with `devices_per_slice` for `devices` over `slices` slices."""
    if slices is None:
        return profile
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1 or devices % slices:
        raise PlanError(
            f"advise(devices={devices}, slices={slices!r}): expected a positive number of slices that "
            f"divides the {devices} devices, e.g. slices=2."
        )
    if slices > 1 and profile.dcn_bytes_per_s is None:
        raise PlanError(
            f"advise(slices={slices}, device={profile.name!r}): the profile has no dcn_bytes_per_s, the "
            "rate between slices. Pass a DeviceProfile with one (dataclasses.replace(profile, "
            "dcn_bytes_per_s=...))."
        )
    return dataclasses.replace(profile, devices_per_slice=devices // slices if slices > 1 else None)


def _predict_layout(
    layout: Layout,
    moe: bool,
    shapes: Any,
    opt_state: Any,
    tokens: Any,
    plain: tuple[Any, Analysis],
    piped: tuple[Any, Analysis | None],
    profile: DeviceProfile,
) -> Prediction:
    """The prediction of one candidate `layout`, from the loss and its analysis
    (`plain`, or `piped` for a pipeline plan: the `PipelineLoss` and its
    analysis). Raises `EqxparError` where the layout cannot run the model or
    batch (`advise` skips it, naming why)."""
    loss_fn, analysis = plain
    if moe and layout.options.get("sequence_parallel"):
        # The layer refuses it when the step is built (eqxpar.nn.MoE).
        raise PlanError("MoE layers do not run under manual sequence parallelism yet")
    plan = Plan(placeholder_mesh(layout.mesh), **layout.options)
    batch = BatchLayout.of(plan)
    need = batch.rows_per_call
    if analysis.batch_size % need:
        raise PlanError(f"the batch of {analysis.batch_size} does not split into {need}")
    # The candidate's own mesh sizes (the plan's context axis).
    context = layout.mesh.get(CONTEXT_AXIS, 1)
    if context > 1 and analysis.seq_len % (2 * context):
        raise PlanError(f"sequence {analysis.seq_len} does not split into {2 * context} chunks")
    if batch.pipelined:
        loss_fn, analysis = piped
    return predict(plan, shapes, opt_state, tokens, loss_fn, analysis, profile)
