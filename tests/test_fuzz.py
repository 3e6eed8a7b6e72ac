"""A seeded Hypothesis fuzz of plans x models x batches: every example either
raises an `eqxpar.EqxparError` or runs one step that matches one device.

Each example (a "spec": mesh sizes, the plan's keyword arguments, a model, a
loss form, a batch shape, `accumulate`) is built, initialised, compiled and run
for ONE step in a worker process (tests/_fuzz_worker.py), and the step's loss,
gradients, gradient norm and SGD update are compared with a single-device
`jax.value_and_grad` at the same initial parameters (rtol 1e-5 in float32; the
bfloat16 tolerances, and why, are in the worker). Besides data / pipe / fsdp /
tensor plans of random models, the specs draw:

- `context` axes with ring, all-gather and Ulysses attention, and `expert` axes
  with MoE GPTs (experts split over them; top-1/2, shared experts, sigmoid
  scores, load-balance loss);
- uneven pipeline stages (`stage_layers`, stacks of any depth);
- `make_step(..., skip_nonfinite=True)`, and for float inputs a step on a batch
  with a NaN first, which must leave the state bit for bit as it was;
- models that enter through `from_pretrained(path, plan)` (the tiny Hugging Face
  checkpoints in tests/data), whose natural order must hold the bits of
  `from_pretrained(path)`;
- journeys: the trained state saved with `CheckpointManager` and restored under
  another drawn plan (bit for bit the trained state in natural order), then
  mostly one more step under that plan, compared with one device.

Findings, each failing the test:

- any exception that is not an `eqxpar.EqxparError` (type, message, traceback);
- a step that runs but does not match one device (or ignores compute_dtype);
- any warning (XLA:CPU's declined donations aside, as in pyproject.toml; the
  scheduler-flag RuntimeWarning is a finding too: the worker sets the flag);
- an abort (the worker process dies: an XLA check failure) or a hang (no
  progress within the phase's time limit: a collective whose peers never come).

Aborts and hangs cannot be caught in-process, hence the worker: it announces
each phase (build, init, compile, run, reference, compare) before entering it,
and the harness kills and replaces a worker that dies or stalls, charging the
example and phase it was in.

Design:

- Hypothesis (seeded with `@seed`, no example database) only *generates* the
  specs; they are then run by a pool of worker processes, and the test fails at
  the end listing every distinct failure class with its count, an example spec
  and the command that reruns it (`python tests/_fuzz_worker.py --spec ...`, or
  `--snippet ...` for a standalone Python reproducer). Reporting every class in
  one CI run is worth more than Hypothesis stopping at the first failure.
- Shrinking is therefore off in CI (it would also re-run compiles, seconds
  each, for minutes). Locally, `EQXPAR_FUZZ_SHRINK=1` runs the examples inside
  Hypothesis instead, one at a time, so a failure raises and Hypothesis shrinks
  it to a minimal spec.
- Two examples in five get one deliberate fault (a bad mesh size, plan option,
  rule, model shape, batch size, loss form...); the rest are drawn to be
  coherent, and most of them run. The test also asserts that at least a third
  of all examples ran a step and were compared with one device (about half do),
  and that each of the draws above (`REQUIRED_DRAWS`) was compared at least once.
- Tiny dimensions (widths 8-32, sequences 4-8, batches <= 48, depth <= 8) and
  few distinct model shapes keep compilation, nearly all of the cost, small;
  the workers share a compilation cache and cache models and references.

Two runs, both in `make test-slow` (CI runs it; `make test` is held to 12 minutes):
`test_plan_fuzz` (60 examples) and `test_plan_fuzz_deep` (600 more, from the next seed).
Knobs (environment): `EQXPAR_FUZZ_EXAMPLES` (default 60),
`EQXPAR_FUZZ_DEEP_EXAMPLES` (default 600), `EQXPAR_FUZZ_SEED`
(default 0), `EQXPAR_FUZZ_WORKERS` (default 2), `EQXPAR_FUZZ_REPORT` (write every
result as JSON to this path), `EQXPAR_FUZZ_SHRINK=1` (see above),
`EQXPAR_FUZZ_RUN_TIMEOUT` (seconds a compiled step may run, default 20) and
`EQXPAR_FUZZ_PHASE_TIMEOUT` (any other phase, default 120).
"""

import collections
import json
import os
import pathlib
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

WORKER = pathlib.Path(__file__).with_name("_fuzz_worker.py")
ROOT = WORKER.parent.parent
PREFIX = "@@FUZZ "

EXAMPLES = int(os.environ.get("EQXPAR_FUZZ_EXAMPLES", "60"))
DEEP_EXAMPLES = int(os.environ.get("EQXPAR_FUZZ_DEEP_EXAMPLES", "600"))
SEED = int(os.environ.get("EQXPAR_FUZZ_SEED", "0"))
WORKERS = max(1, int(os.environ.get("EQXPAR_FUZZ_WORKERS", "2")))
RUN_TIMEOUT = float(os.environ.get("EQXPAR_FUZZ_RUN_TIMEOUT", "20"))
PHASE_TIMEOUT = float(os.environ.get("EQXPAR_FUZZ_PHASE_TIMEOUT", "120"))
SHRINK = os.environ.get("EQXPAR_FUZZ_SHRINK", "0") == "1"
REPORT = os.environ.get("EQXPAR_FUZZ_REPORT")

# --- Strategies ------------------------------------------------------------------------
#
# A spec is plain JSON. Plan arguments are Python source (evaluated by the worker
# with eqxpar, rules, stage_rules, P = PartitionSpec and jnp in scope), so that a
# reproducer can print them verbatim. Options are listed simplest first:
# Hypothesis shrinks towards the first.

AXES = ("data", "pipe", "fsdp", "expert", "context", "tensor")
DTYPES = ["None"] * 6 + ["'bfloat16'", "jnp.float32"]

# Model kinds, as often as they appear here. "moe": an MoE GPT (`expert` splits its
# experts); "pretrained": a GPT read with `from_pretrained(path, plan)` from a tiny
# Hugging Face checkpoint in tests/data (name -> its layers below).
KINDS = [
    "plain",
    "seq",
    "classifier",
    "lm",
    "plain",
    "gpt",
    "seq",
    "lm",
    "plain",
    "classifier",
    "pretrained",
    "moe",
]
STACKED_KINDS = ("seq", "lm", "gpt", "moe", "pretrained")
PIPELINE_KINDS = ("seq", "lm", "gpt", "pretrained")  # an MoE GPT refuses pipelines
SEQUENCE_KINDS = ("seq", "lm", "gpt", "moe", "pretrained")  # what `context` can split
ATTENTION_KINDS = ("gpt", "moe", "pretrained")
FLOAT_INPUT_KINDS = ("plain", "classifier", "seq")  # a NaN fits in their batches
PRETRAINED = {"llama": 2, "qwen2": 2, "mistral": 2, "gpt2": 2, "llama3_rope": 2, "mixtral": 2, "llama8": 8}
CONTEXT_ATTENTION = ["None", "'ring'", "'allgather'", "'ulysses'"]
BATCH_AXES_OPTIONS = [None] * 8 + ["('data',)", "()", "('data', 'fsdp')", "('fsdp',)", "('data', 'tensor')"]
EXPERT_BATCH_AXES_OPTIONS = [None] * 8 + [
    "('data', 'expert')",
    "('expert',)",
    "('data', 'fsdp', 'expert')",
    "('data',)",
]

PLAIN_RULES = [
    "None",
    "rules.FSDP(min_size=16)",
    "rules.FSDP()",
    "rules.FSDP(min_size=1)",
    "rules.FSDP(axis='data', min_size=16)",
    "rules.FSDP(axis=('data', 'fsdp'), min_size=16)",
    "rules.ByPath([(r'layers\\[0\\]\\.weight$', P('fsdp', None))], strict=False)",
    "rules.ByPath([(r'weight$', P(None, 'tensor'))], strict=False)",
    "rules.Policy(lambda leaf: P('fsdp') if len(leaf.shape) == 2 and leaf.shape[0] % 4 == 0 else None)",
]
NN_RULES = [
    "rules.MEGATRON",
    "None",
    "rules.MEGATRON_FSDP",
    "rules.MEGATRON",
    "rules.MEGATRON_FSDP",
    "rules.MEGATRON",
    "rules.FSDP(min_size=16)",
    "[rules.MEGATRON, rules.FSDP(min_size=16)]",
    "rules.Logical({'mlp': 'tensor', 'heads': 'tensor', 'kv_heads': 'tensor', 'vocab': 'tensor', 'embed': 'data'})",
    "rules.Logical({'vocab': 'tensor'})",
    "rules.Logical({'mlp': 'tensor'})",
    "rules.ByPath([(r'mlp\\.w_in$', P(None, None, None, 'tensor')), (r'mlp\\.w_out$', P(None, 'tensor', None))], strict=False)",
]
MOE_RULES = ["rules.EXPERT", "rules.EXPERT", "[rules.EXPERT, rules.FSDP(min_size=16)]"]

# One fault each; the examples that get one should be rejected with an EqxparError
# (or, where the fault turns out harmless in its context, run and match).
FAULTS = [
    # meshes
    ("mesh", "zero"),
    ("mesh", "too_big"),
    ("mesh", "two_inferred"),
    ("mesh", "inferred_not_dividing"),
    ("mesh", "float_size"),
    ("mesh", "bool_size"),
    # plans
    ("plan", "mode", "'bogus'"),
    ("plan", "manual_axes_auto", None),
    ("plan", "manual_axes", "()"),
    ("plan", "manual_axes", "('bogus',)"),
    ("plan", "tp_overlap_alone", None),
    ("plan", "remat", "'bogus'"),
    ("plan", "schedule", "'bogus'"),
    ("plan", "microbatches", "0"),
    ("plan", "microbatches", "2"),
    ("plan", "chunks", "2"),
    ("plan", "batch_axes", "3"),
    ("plan", "batch_axes", "('bogus',)"),
    ("plan", "annotations", "{'a': 3}"),
    ("plan", "annotations", "{'a': P('bogus')}"),
    ("plan", "rules", "3"),
    ("plan", "rules", "rules.FSDP(axis=1)"),
    ("plan", "rules", "rules.FSDP(min_size=-1)"),
    ("plan", "rules", "rules.ByPath([('[unclosed', P())])"),
    ("plan", "rules", "rules.ByPath([(r'^nothing$', P())], strict=True)"),
    ("plan", "rules", "rules.Logical({'mlp': 'bogus'})"),
    ("plan", "rules", "rules.ByPath([(r'.', P('tensor', 'tensor'))], strict=False)"),
    ("plan", "tensor_axis", "'bogus'"),
    ("plan", "param_dtype", "jnp.int32"),
    ("plan", "compute_dtype", "'bogus'"),
    ("plan", "reduce_dtype", "jnp.int8"),
    # models
    ("model", "kv_heads_zero"),
    ("model", "heads_not_dividing"),
    ("model", "not_divisible_by_tensor"),
    ("model", "depth_not_multiple"),
    ("model", "seq_too_long"),
    # batches
    ("batch", "size_not_dividing"),
    ("batch", "accumulate_not_dividing"),
    ("batch", "seq_not_dividing"),
    ("batch", "accumulate_zero"),
    ("batch", "accumulate_pipeline"),
    # losses
    ("loss", "plain_loss_in_pipeline"),
    ("loss", "naive_loss_sequence_parallel"),
]


def _divisors(n):
    return [d for d in (1, 2, 4, 8) if n % d == 0]


@st.composite
def specs(draw):
    # Weighted by cost: a GPT step compiles in about twice the time of the
    # other eqxpar.nn models and four times a plain MLP's; an MoE GPT and a model
    # read with from_pretrained (a GPT too) cost about a GPT's.
    kind = draw(st.sampled_from(KINDS))
    name = None
    pipeline = kind in PIPELINE_KINDS and draw(st.integers(0, 9)) < 4
    if kind == "pretrained":
        # Pipelines take the 8-layer checkpoint mostly (the 2-layer ones fit 2 stages);
        # Mixtral is an MoE GPT, which refuses pipelines.
        name = draw(st.sampled_from(["llama8", "llama8", "qwen2", "gpt2"] if pipeline else list(PRETRAINED)))
    moe = kind == "moe" or name == "mixtral"
    fixed_depth = PRETRAINED[name] if name else None
    layout = _draw_layout(draw, kind, pipeline=pipeline, moe=moe, fixed_depth=fixed_depth)
    mesh, plan, sizes = layout["mesh"], layout["plan"], layout["sizes"]
    microbatches, depth = layout["microbatches"], layout["depth"]
    model = _draw_model(draw, kind, depth, name)
    stacked = kind in STACKED_KINDS
    loss = "pipeline" if pipeline or (stacked and kind != "seq" and draw(st.booleans())) else "plain"
    if kind == "seq":
        # "pipeline_raw": a PipelineLoss whose first part uses no weights.
        forms = ["pipeline", "pipeline_raw"] if pipeline else ["plain", "pipeline", "naive", "pipeline_raw"]
        loss = draw(st.sampled_from(forms))
    if moe:
        loss = "plain"  # lm_loss adds the auxiliary losses; a PipelineLoss's gpt_last does not

    # Batch: a multiple of the data-parallel size x accumulate x micro-batches.
    accumulate = 1 if pipeline else draw(st.sampled_from([1, 1, 2, 3]))
    if kind == "moe" and accumulate > 1:
        # Micro-batches make the load-balance loss a mean of per-micro-batch values
        # (an AccumulationWarning, and not one device's loss); without it they are exact.
        model["load_balance"] = 0.0
    size = _batch_size(draw, plan, sizes, accumulate * microbatches)
    seq = draw(st.sampled_from([8, 8, 8, 4]))
    spec = {
        "mesh": mesh,
        "plan": plan,
        "model": model,
        "loss": loss,
        "batch": {"size": size, "seq": seq},
        "accumulate": accumulate,
    }
    # The new draws test "0 = without": Hypothesis draws small integers more often
    # in its first examples, which the default run is made of.
    if draw(st.integers(0, 9)) >= 8:
        # A step that skips non-finite updates: on a good batch it is the plain
        # step; on a batch with a NaN (float inputs only: token ids cannot hold
        # one) it must leave the state bit for bit as it was, then train on.
        spec["skip_nonfinite"] = True
        if kind in FLOAT_INPUT_KINDS and draw(st.booleans()):
            spec["poison"] = True
    if draw(st.integers(0, 4)) >= 3:
        where = draw(st.sampled_from(["plan", "mesh", "model", "batch", "loss", "plan"]))
        fault = draw(st.sampled_from([f for f in FAULTS if f[0] == where]))
        _apply_fault(draw, spec, fault, sizes, pipeline)
    elif draw(st.integers(0, 9)) >= 8:
        spec["journey"] = _draw_journey(draw, spec, moe)
    # Double quotes inside the Python sources: the rerun commands quote the JSON
    # in single quotes.
    spec["plan"] = {k: v.replace("'", '"') for k, v in spec["plan"].items()}
    if "journey" in spec:
        spec["journey"]["plan"] = {k: v.replace("'", '"') for k, v in spec["journey"]["plan"].items()}
    return spec


def _draw_mesh(draw, kind, *, pipeline, moe, max_stages):
    """Mesh sizes whose product is at most 8 (size-1 axes included; `expert` and
    `context` only where drawn), as given and with a -1 filled in."""
    tensor = draw(st.sampled_from([2, 1, 4]))
    pipe = draw(st.sampled_from([2, 1, 4])) if pipeline else draw(st.sampled_from([1] * 5 + [2]))
    while tensor * pipe > 8 or pipe > max_stages:
        pipe //= 2
    context = draw(st.sampled_from([2, 4])) if kind in SEQUENCE_KINDS and draw(st.integers(0, 9)) < 3 else 1
    while tensor * pipe * context > 8:
        context //= 2
    # `expert` splits an MoE layer's experts, and is one more batch axis elsewhere.
    expert = draw(st.sampled_from([2, 4, 1, 2])) if moe else (2 if draw(st.integers(0, 19)) == 0 else 1)
    while tensor * pipe * context * expert > 8:
        expert //= 2
    rest = 8 // (tensor * pipe * context * expert)
    data = draw(st.sampled_from(_divisors(rest)))
    fsdp = draw(st.sampled_from(_divisors(rest // data)))
    mesh = {"data": data, "pipe": pipe, "fsdp": fsdp, "tensor": tensor}
    if expert > 1:
        mesh["expert"] = expert
    if context > 1:
        mesh["context"] = context
    if draw(st.integers(0, 9)) == 0:  # "the rest": -1 fills the 8 devices
        mesh[draw(st.sampled_from([a for a in AXES if a in mesh]))] = -1
    sizes = dict(mesh)
    known = 1
    for v in mesh.values():
        known *= v if v != -1 else 1
    for a, v in mesh.items():
        if v == -1:
            sizes[a] = 8 // known
    for a in AXES:
        sizes.setdefault(a, 1)
    return mesh, sizes


def _draw_layout(draw, kind, *, pipeline, moe, fixed_depth=None):
    """A mesh and a plan for a model of `kind` (of `fixed_depth` layers where the
    model is given, e.g. read from a checkpoint): their sizes, the pipeline's
    micro-batches and the stack's depth."""
    stacked = kind in STACKED_KINDS
    mesh, sizes = _draw_mesh(draw, kind, pipeline=pipeline, moe=moe, max_stages=fixed_depth or 8)
    present = [a for a in AXES if a in mesh]

    plan = {}
    # A pipeline plan takes no mode (it always runs manual; mode= is refused): one
    # in ten draws it anyway.
    mode = (
        draw(st.sampled_from(["auto", "manual"]))
        if not pipeline
        else ["auto", "manual"][draw(st.integers(0, 9)) == 9]
    )
    if mode == "manual":
        plan["mode"] = "'manual'"
        if not pipeline and draw(st.booleans()):
            subset = draw(st.sets(st.sampled_from(present), min_size=1, max_size=3))
            # A step is always manual over `context` and `expert` (a plan whose
            # manual_axes leave them out is refused): nine subsets in ten name them.
            if draw(st.integers(0, 9)) > 0:
                subset |= {a for a in ("expert", "context") if a in mesh}
            plan["manual_axes"] = repr(tuple(a for a in present if a in subset))
    if kind in ("plain", "classifier"):
        rule = draw(st.sampled_from(PLAIN_RULES if kind == "plain" else NN_RULES[:8] + PLAIN_RULES[1:4]))
    else:
        rule = draw(st.sampled_from(NN_RULES + (MOE_RULES if moe else [])))
    if pipeline:
        rule = "stage_rules()" if rule == "None" else f"stage_rules({rule})"
    if rule != "None":
        plan["rules"] = rule
    # `expert` is a batch axis (batch_axes without it are refused).
    batch_axes = draw(st.sampled_from(EXPERT_BATCH_AXES_OPTIONS if "expert" in mesh else BATCH_AXES_OPTIONS))
    if batch_axes is not None:
        plan["batch_axes"] = batch_axes
    if draw(st.integers(0, 9)) == 0:
        plan["annotations"] = draw(
            st.sampled_from(["{'activations': P(('data', 'fsdp'))}", "{'extra': P('tensor')}"])
        )
    if "context" in mesh:
        # Ring (the default outside pipelines, refused in them), all-gather and
        # Ulysses (query heads per device a multiple of the context size; a
        # tensor axis must be manual); models without attention ignore the choice.
        options = CONTEXT_ATTENTION if kind in ATTENTION_KINDS else ["None", "None", "'allgather'"]
        attention = draw(st.sampled_from(options))
        if attention != "None":
            plan["context_attention"] = attention
    sequence_parallel = kind in SEQUENCE_KINDS and draw(st.integers(0, 9)) < 4
    if sequence_parallel:
        plan["sequence_parallel"] = "True"
        if draw(st.integers(0, 9)) < (4 if mode == "manual" else 2):
            plan["tp_overlap"] = "True"
    if draw(st.integers(0, 9)) < 2:
        plan["zero1"] = "True"
    if stacked:
        remat = draw(st.sampled_from(["none", "dots", "inputs", "full"]))
        if remat != "none":
            plan["remat"] = repr(remat)
    microbatches, depth = 1, 2
    if pipeline:
        microbatches, depth = _draw_pipeline(draw, plan, sizes["pipe"], fixed_depth)
    if fixed_depth:
        depth = fixed_depth
    for what in ("param_dtype", "compute_dtype", "reduce_dtype"):
        dtype = draw(st.sampled_from(DTYPES))
        if dtype != "None":
            plan[what] = "jnp.bfloat16" if dtype == "'bfloat16'" else dtype
    return {"mesh": mesh, "plan": plan, "sizes": sizes, "microbatches": microbatches, "depth": depth}


def _draw_pipeline(draw, plan, pipe, fixed_depth):
    """The schedule, micro-batches, chunks and (uneven, one time in three) the
    layers of each virtual stage; returns (micro-batches, depth)."""
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble"]))
    plan["schedule"] = repr(schedule)
    chunks = 1
    if schedule == "interleaved":
        chunks = draw(st.sampled_from([1, 2]))
        if fixed_depth and pipe * chunks > fixed_depth:
            chunks = 1
        microbatches = pipe * draw(st.sampled_from([1, 2]))
    else:
        microbatches = draw(st.sampled_from([1, 2, 4]))
    if microbatches != 1:
        plan["microbatches"] = repr(microbatches)
    if chunks != 1:
        plan["chunks"] = repr(chunks)
    stages = pipe * chunks
    depth = fixed_depth or max(2, stages)
    if stages > 1 and draw(st.integers(0, 2)) == 0:
        # Uneven stages: a stack of any depth from one layer per stage up (the
        # plan stores every device's rows padded to the longest stage, in its
        # order), its layers dealt to the stages at random.
        if not fixed_depth:
            depth = draw(st.sampled_from([stages + 1, stages + 2, 2 * stages - 1, 2 * stages]))
        counts = [1] * stages
        for _ in range(depth - stages):
            counts[draw(st.integers(0, stages - 1))] += 1
        plan["stage_layers"] = repr(tuple(counts))
    return microbatches, depth


def _draw_model(draw, kind, depth, name):
    # Tiny, dimensions the tensor axis divides, few distinct shapes (the worker
    # caches models and single-device references by shape).
    if kind == "plain":
        return {"kind": kind, "d_in": 8, "d_out": 4, "hidden": 16, "depth": draw(st.sampled_from([1, 2]))}
    if kind == "classifier":
        return {"kind": kind, "d_in": 8, "hidden": 16, "classes": 4, "depth": draw(st.sampled_from([1, 2]))}
    if kind == "seq":
        activation = draw(st.sampled_from(["gelu", "swiglu"]))
        return {"kind": kind, "d": 16, "hidden": 16, "depth": depth, "activation": activation}
    if kind == "lm":
        return {"kind": kind, "vocab": 16, "d": 16, "hidden": 16, "depth": depth, "activation": "gelu"}
    if kind == "pretrained":
        # A tiny Hugging Face checkpoint (tests/data), read into the plan.
        return {"kind": kind, "name": name, "vocab": 64, "depth": depth}
    # The two flavours tests/test_models.py checks: tied + SwiGLU + RMSNorm +
    # grouped-query, and untied + GELU + LayerNorm.
    flavour = draw(st.sampled_from(["gqa", "classic"]))
    model = {
        "kind": kind,
        "vocab": 16,
        "d": 16,
        "heads": 4 if flavour == "gqa" else 2,
        "kv_heads": 2 if flavour == "gqa" else None,
        "hidden": 32 if kind == "gpt" else 16,
        "depth": depth,
        "activation": "swiglu" if flavour == "gqa" else "gelu",
        "norm": "rms" if flavour == "gqa" else "layer",
        "tied": flavour == "gqa",
        "max_seq_len": 16,
    }
    if kind == "moe":
        # 4 experts (split over expert=2 or 4), every block or every second one.
        score = draw(st.sampled_from(["softmax", "sigmoid"]))
        model.update(
            moe_every=draw(st.sampled_from([2, 1])),
            experts=4,
            top_k=draw(st.sampled_from([2, 1])),
            score=score,
            shared=draw(st.sampled_from([0, 1])),
            # None: dropless; 8.0: room for every token (a smaller capacity drops
            # tokens by each device's count, not one device's).
            capacity=draw(st.sampled_from([None, 8.0])) if score == "softmax" else None,
            load_balance=draw(st.sampled_from([0.01, 0.0])),
        )
    return model


def _batch_size(draw, plan, sizes, multiple):
    if "batch_axes" in plan:
        axes = eval(plan["batch_axes"])  # noqa: S307 (our own literal)
    else:  # the plan's default: `expert` joins where it splits something
        axes = ("data", "fsdp", "expert")
    dp = 1
    for a in axes:
        dp *= sizes.get(a, 1)
    size = dp * multiple * draw(st.sampled_from([1, 2]))
    while size > 48:
        size //= 2
    return size


def _draw_journey(draw, spec, moe):
    """Another plan to restore the trained state under (the checkpoint holds it in
    natural order; the restore stores it in this plan's order), with a batch for
    one more step under it. The model, loss form and param_dtype stay."""
    kind, model = spec["model"]["kind"], spec["model"]
    pipeline = (
        kind in PIPELINE_KINDS
        and not moe
        and spec["loss"] in ("pipeline", "pipeline_raw")
        and draw(st.integers(0, 9)) < 4
    )
    fixed = model["depth"] if kind in STACKED_KINDS else None
    layout = _draw_layout(draw, kind, pipeline=pipeline, moe=moe, fixed_depth=fixed)
    plan = layout["plan"]
    # The restore must give back the trained bits: the same stored dtype.
    plan.pop("param_dtype", None)
    if "param_dtype" in spec["plan"]:
        plan["param_dtype"] = spec["plan"]["param_dtype"]
    if spec["loss"] == "naive":  # written without split_sequence: not for sequence parallelism
        plan.pop("sequence_parallel", None)
        plan.pop("tp_overlap", None)
    return {
        "mesh": layout["mesh"],
        "plan": plan,
        "batch": {"size": _batch_size(draw, plan, layout["sizes"], layout["microbatches"])},
        # Most journeys train on under the new plan (compared with one device);
        # the others only restore (compared bit for bit with the trained state).
        "step": draw(st.integers(0, 3)) > 0,
    }


def _apply_fault(draw, spec, fault, sizes, pipeline):
    where, what = fault[0], fault[1]
    spec["fault"] = "/".join(str(f) for f in fault if f is not None)
    mesh, plan, model, batch = spec["mesh"], spec["plan"], spec["model"], spec["batch"]
    if where == "mesh":
        axis = draw(st.sampled_from(AXES))
        if what == "zero":
            mesh[axis] = 0
        elif what == "too_big":
            mesh[axis] = sizes[axis] * 16
        elif what == "two_inferred":
            mesh["data"], mesh["tensor"] = -1, -1
        elif what == "inferred_not_dividing":
            mesh.update(data=-1, tensor=3, pipe=1, fsdp=1)
        elif what == "float_size":
            mesh[axis] = float(sizes[axis])
        elif what == "bool_size":
            mesh[axis] = True
    elif where == "plan":
        value = fault[2]
        if what == "manual_axes_auto":
            plan.pop("mode", None)
            plan["manual_axes"] = "('tensor',)"
        elif what == "tp_overlap_alone":
            plan.pop("sequence_parallel", None)
            plan["tp_overlap"] = "True"
        elif what == "manual_axes":
            plan["mode"] = "'manual'"
            plan["manual_axes"] = value
        else:
            plan[what] = value
    elif where == "model":
        kind = model["kind"]
        gpt = kind in ("gpt", "moe")  # a checkpoint's shapes are the checkpoint's
        if kind == "pretrained":
            return
        if what == "kv_heads_zero" and gpt:
            model["kv_heads"] = 0
        elif what == "heads_not_dividing" and gpt:
            model["heads"], model["kv_heads"] = 3, None
        elif what == "not_divisible_by_tensor":
            for field in ("hidden", "vocab"):
                if field in model:
                    model[field] = 6 if field == "hidden" else 12
            if gpt:
                model.update(d=24, heads=3, kv_heads=None)
                # 24 / 3 = 8, even: valid alone; 3 heads do not split over tensor 2 or 4
        elif what == "depth_not_multiple" and "depth" in model:
            model["depth"] = 3
        elif what == "seq_too_long" and gpt:
            model["max_seq_len"] = 4
            batch["seq"] = 8
    elif where == "batch":
        if what == "size_not_dividing":
            batch["size"] += 1
        elif what == "accumulate_not_dividing":
            spec["accumulate"] = 3 if batch["size"] % 3 else 5
        elif what == "seq_not_dividing":
            batch["seq"] = 5
            if model["kind"] in SEQUENCE_KINDS:
                plan["sequence_parallel"] = "True"
        elif what == "accumulate_zero":
            spec["accumulate"] = 0
        elif what == "accumulate_pipeline" and pipeline:
            spec["accumulate"] = 2
            batch["size"] *= 2
    elif where == "loss":
        if what == "plain_loss_in_pipeline" and pipeline:
            spec["loss"] = "plain"
            if model["kind"] == "seq":
                spec["loss"] = draw(st.sampled_from(["plain", "naive"]))
        elif what == "naive_loss_sequence_parallel" and model["kind"] == "seq" and not pipeline:
            spec["loss"] = "naive"
            plan["sequence_parallel"] = "True"


def _new_draws(spec):
    """The dimensions beyond data / pipe / fsdp / tensor plans of random models that
    the spec draws (counted in the summary)."""
    plan = spec["plan"]
    if "context" in spec["mesh"]:
        yield "context:" + plan.get("context_attention", "default").strip("'\"")
    if "expert" in spec["mesh"]:
        yield "expert"
    if spec["model"]["kind"] == "moe":
        yield "moe"
    if "stage_layers" in plan:
        yield "stage_layers"
    if spec.get("skip_nonfinite"):
        yield "skip_nonfinite+poison" if spec.get("poison") else "skip_nonfinite"
    if spec["model"]["kind"] == "pretrained":
        yield "from_pretrained"
    if "journey" in spec:
        yield "journey" + ("+step" if spec["journey"]["step"] else "")


# --- Worker processes -------------------------------------------------------------------


def _worker_env(jaxtyping_packages, cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its own
    env["EQXPAR_FUZZ_CACHE_DIR"] = str(cache_dir)
    env.pop("PYTEST_CURRENT_TEST", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if jaxtyping_packages:
        env["EQXPAR_FUZZ_JAXTYPING"] = jaxtyping_packages
    return env


class Worker:
    """One `_fuzz_worker.py --serve` process (its own process group, so that a
    kill reaches any children XLA started)."""

    def __init__(self, env, *, run_timeout=RUN_TIMEOUT, phase_timeout=PHASE_TIMEOUT):
        self.run_timeout, self.phase_timeout = run_timeout, phase_timeout
        # The worker appends to the file (O_APPEND), this side reads it through
        # its own handle: no shared offset to race on.
        fd, self.stderr_path = tempfile.mkstemp(prefix="eqxpar-fuzz-", suffix=".stderr")
        os.close(fd)
        with open(self.stderr_path, "ab") as child_stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", str(WORKER), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=child_stderr,
                cwd=ROOT,
                env=env,
                text=True,
                start_new_session=True,
            )
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        event = self._next(self.phase_timeout)
        if event is None or event.get("event") != "ready":
            tail = self.stderr_tail()
            self.close()
            raise RuntimeError(f"fuzz worker failed to start: {event!r}\n{tail}")

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.lines.put(json.loads(line[len(PREFIX) :]))
        self.lines.put({"event": "eof"})

    def _next(self, timeout):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def _stderr_size(self):
        return os.path.getsize(self.stderr_path)

    def stderr_tail(self, n=4000):
        return self._stderr_since(max(0, self._stderr_size() - n))

    def _stderr_since(self, mark, n=20000):
        with open(self.stderr_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")[-n:]

    def run(self, spec):
        """The worker's result for `spec`, or an abort / hang result (after which
        this worker is dead and must be replaced)."""
        start = time.perf_counter()
        mark = self._stderr_size()
        try:
            self.proc.stdin.write(json.dumps(spec) + "\n")
            self.proc.stdin.flush()
        except OSError as e:  # died after its last result: not this example's doing
            raise WorkerGone from e
        phase = "start"
        while True:
            # "run", "poisoned run", "journey run": a compiled step.
            limit = self.run_timeout if phase.endswith("run") else self.phase_timeout
            event = self._next(limit)
            if event is None:
                self.kill()
                return {
                    "id": spec["id"],
                    "outcome": "hang",
                    "phase": phase,
                    "message": f"no progress for {limit:.0f} s in phase {phase!r}",
                    "stderr": self._stderr_since(mark, 4000),
                    "seconds": time.perf_counter() - start,
                }
            if event["event"] == "phase":
                phase = event["phase"]
            elif event["event"] == "result":
                event["seconds"] = time.perf_counter() - start
                return event
            elif event["event"] == "eof":
                code = self.proc.wait()
                err = self._stderr_since(mark)
                return {
                    "id": spec["id"],
                    "outcome": "abort",
                    "phase": phase,
                    "returncode": code,
                    "message": _abort_line(err) or f"worker exited with status {code}",
                    "stderr": err[-4000:],
                    "seconds": time.perf_counter() - start,
                }

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self):
        """Stop the worker (EOF on its stdin; killed if it lingers) and release
        its pipes and stderr file."""
        if not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # a dead worker's pipe
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(timeout=30)
        self.proc.stdout.close()
        os.unlink(self.stderr_path)


class WorkerGone(Exception):
    """The worker was dead before it was given an example."""


def _abort_line(stderr):
    # XLA's fatal log line ("F1123 11:41:59.880685 8801 file.cc:123] message").
    for line in stderr.splitlines():
        if re.match(r"^F\d{4} ", line) or "Check failed" in line or "Fatal Python error" in line:
            return line.strip()
    return None


class Pool:
    def __init__(self, n, env):
        self.env = env
        self.n = n
        self.restarts = 0

    def run_all(self, spec_list):
        todo: queue.Queue = queue.Queue()
        for spec in spec_list:
            todo.put(spec)
        results = {}
        lock = threading.Lock()
        errors = []

        def drive():
            worker = None
            try:
                while True:
                    try:
                        spec = todo.get_nowait()
                    except queue.Empty:
                        return
                    for attempt in range(2):
                        if worker is None or not worker.alive():
                            if worker is not None:
                                worker.close()
                                with lock:
                                    self.restarts += 1
                            worker = Worker(self.env)
                        try:
                            result = worker.run(spec)
                            break
                        except WorkerGone:
                            if attempt:
                                raise
                            worker.kill()
                    with lock:
                        results[spec["id"]] = result
            except Exception as e:  # noqa: BLE001 (reported by the test)
                errors.append(e)
            finally:
                if worker is not None:
                    worker.close()

        threads = [threading.Thread(target=drive) for _ in range(min(self.n, max(1, len(spec_list))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [results[s["id"]] for s in spec_list]


# --- Classification and report ---------------------------------------------------------------


def _normalise(text):
    text = text.strip().splitlines()[0] if text.strip() else ""
    text = re.sub(r"P\(.*?\)(?= has)", "P(...)", text)
    text = re.sub(r"0x[0-9a-f]+", "0x_", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return text[:160]


def finding_classes(result):
    """The (kind, description) classes this result counts toward; empty when clean."""
    classes = []
    outcome = result["outcome"]
    if outcome == "other_error":
        classes.append(
            ("exception", f"{result['type']}: {_normalise(result['message'])} [phase {result['phase']}]")
        )
    elif outcome == "mismatch":
        msg = re.sub(r"gradient \S+", "gradient <leaf>", result["message"])
        msg = re.sub(r"parameter \S+", "parameter <leaf>", msg)
        classes.append(("mismatch", _normalise(msg)))
    elif outcome == "abort":
        msg = re.sub(r"^F\d{4} [\d:.]+\s+\d+ ", "F ", result["message"])
        classes.append(("abort", f"{_normalise(msg)} [phase {result['phase']}]"))
    elif outcome == "hang":
        classes.append(("hang", f"no progress in phase {result['phase']}"))
    for w in result.get("warnings", []):
        classes.append(("warning", _normalise(w)))
    return classes


def _command(spec, flag="--spec", env=None):
    # Under the suite's jaxtyping hook the rerun needs it too (type-check errors).
    hook = (env or {}).get("EQXPAR_FUZZ_JAXTYPING")
    prefix = f"EQXPAR_FUZZ_JAXTYPING={hook} " if hook else ""
    spec_json = shlex.quote(json.dumps(spec, separators=(",", ":")))
    return f"{prefix}.venv/bin/python tests/_fuzz_worker.py {flag} {spec_json}"


def _compared(result):
    """Whether the example ran a step and compared it with one device (a journey
    or a poisoned step may fail after the first comparison)."""
    return (
        result["outcome"] in ("ok", "mismatch")
        or result.get("compared", 0) > 0
        or result.get("phase") in ("reference", "compare")
    )


#: Each of these draws must be compared with one device at least once in a run
#: (the floor beside "a third of all examples"), so that none is drawn only into
#: refusals: context parallelism, expert parallelism, MoE models, uneven stages,
#: skip_nonfinite, from_pretrained, a checkpoint journey.
REQUIRED_DRAWS = ("context", "expert", "moe", "stage_layers", "skip_nonfinite", "from_pretrained", "journey")


def _uncompared_draws(spec_list, results):
    compared = {
        re.split("[:+]", d)[0]
        for s, r in zip(spec_list, results, strict=True)
        if _compared(r)
        for d in _new_draws(s)
    }
    return [d for d in REQUIRED_DRAWS if d not in compared]


def summarise(spec_list, results, wall, *, seed_value=SEED):
    outcomes = collections.Counter(r["outcome"] for r in results)
    ran = sum(1 for r in results if _compared(r))
    faulted = sum(1 for s in spec_list if "fault" in s)
    drawn = collections.Counter(d for s in spec_list for d in _new_draws(s))
    compared = collections.Counter(
        d for s, r in zip(spec_list, results, strict=True) if _compared(r) for d in _new_draws(s)
    )
    lines = [
        f"plan fuzz: {len(results)} examples (seed {seed_value}, {WORKERS} workers) in {wall:.1f} s",
        f"  outcomes: {dict(sorted(outcomes.items()))}",
        f"  ran a step and compared with one device: {ran} ({ran / max(1, len(results)):.0%}); "
        f"with a deliberate fault: {faulted}",
        "  new draws (drawn / compared with one device): "
        + ", ".join(f"{k} {v}/{compared[k]}" for k, v in sorted(drawn.items())),
    ]
    expected = sum(len(r.get("expected_warnings", [])) for r in results)
    if expected:
        lines.append(f"  expected eqxpar warnings (UnusedAxisWarning): {expected}")
    by_kind = collections.defaultdict(list)
    for s, r in zip(spec_list, results, strict=True):
        by_kind[s["model"]["kind"], r["outcome"]].append((r.get("seconds", 0.0), r.get("cpu", 0.0)))
    lines.append(
        "  per example, by model and outcome: count, wall s (mean, total), worker CPU s (mean, total)"
    )
    for (kind, outcome), secs in sorted(by_kind.items()):
        wall_s, cpu_s = sum(w for w, _ in secs), sum(c for _, c in secs)
        lines.append(
            f"    {kind:10s} {outcome:13s} {len(secs):4d}   {wall_s / len(secs):5.2f} {wall_s:6.1f}   "
            f"{cpu_s / len(secs):5.2f} {cpu_s:6.1f}"
        )
    phases = collections.Counter()
    for r in results:
        for k, v in r.get("times", {}).items():
            phases[k] += v
    lines.append("  seconds by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.most_common()))
    return "\n".join(lines), ran


def report_findings(spec_list, results, env=None):
    classes = collections.OrderedDict()
    for spec, result in zip(spec_list, results, strict=True):
        for cls in finding_classes(result):
            classes.setdefault(cls, []).append((spec, result))
    lines = [
        "(each: how many examples hit it, the shortest of them, and the command that reruns it; "
        "--snippet instead of --spec prints a standalone Python reproducer)"
    ]
    for (kind, desc), hits in sorted(classes.items(), key=lambda item: -len(item[1])):
        spec, result = min(hits, key=lambda h: len(json.dumps(h[0])))
        lines.append(f"[{kind}] x{len(hits)}: {desc}")
        lines.append(f"    e.g. example {spec['id']}: {json.dumps(spec)}")
        if result.get("outcome") in ("abort", "hang") and result.get("stderr"):
            tail = "\n".join(result["stderr"].strip().splitlines()[-4:])
            lines.append("    stderr: " + tail.replace("\n", "\n            "))
        lines.append(f"    rerun: {_command(spec, env=env)}")
    return classes, "\n".join(lines)


# --- The test ----------------------------------------------------------------------------------


def _generate(n, seed_value=SEED):
    found = []

    # Hypothesis repeats itself and draws its first examples alike (small
    # integers, the first option of each choice): draw three times as many, and
    # keep n distinct ones spread evenly over the whole draw.
    @seed(seed_value)
    @settings(
        max_examples=3 * n,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(specs())
    def collect(spec):
        found.append(spec)

    collect()
    distinct, seen = [], set()
    for spec in found:
        key = json.dumps(spec, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        distinct.append(spec)
    unique = [distinct[i * len(distinct) // n] for i in range(min(n, len(distinct)))]
    for i, spec in enumerate(unique):
        spec["id"] = i
    return unique


@pytest.mark.slow  # 60 plans, 2 minutes of both cores: in make test-slow (CI runs it)
def test_plan_fuzz(request, tmp_path):
    _fuzz(request, tmp_path, EXAMPLES, SEED)


@pytest.mark.slow
def test_plan_fuzz_deep(request, tmp_path):
    # `make test-slow` (CI runs it): ten times the examples, drawn from the next
    # seed, so that together with the default run 660 distinct plans are tried.
    _fuzz(request, tmp_path, DEEP_EXAMPLES, SEED + 1)


def _fuzz(request, tmp_path, examples, seed_value):
    # The workers share one compilation cache (this test's temporary directory,
    # or EQXPAR_FUZZ_CACHE_DIR to keep it between runs, e.g. while fixing a bug).
    cache_dir = os.environ.get("EQXPAR_FUZZ_CACHE_DIR") or tmp_path
    env = _worker_env(request.config.getoption("jaxtyping_packages", default=None), cache_dir)
    if SHRINK:
        _shrink(env)
        return
    spec_list = _generate(examples, seed_value)
    start = time.perf_counter()
    pool = Pool(WORKERS, env)
    results = pool.run_all(spec_list)
    wall = time.perf_counter() - start
    summary, ran = summarise(spec_list, results, wall, seed_value=seed_value)
    classes, details = report_findings(spec_list, results, env)
    if REPORT:
        pathlib.Path(REPORT).write_text(
            json.dumps({"summary": summary, "specs": spec_list, "results": results}, indent=1)
        )
    print(summary)
    if len(spec_list) < examples:
        pytest.fail(f"only {len(spec_list)} distinct examples generated, wanted {examples}")
    if classes:
        pytest.fail(f"{summary}\n{len(classes)} finding classes:\n{details}", pytrace=False)
    if ran * 3 < len(results):
        pytest.fail(f"fewer than a third of the examples ran a step:\n{summary}", pytrace=False)
    missing = _uncompared_draws(spec_list, results)
    if missing:
        pytest.fail(
            f"no example of {missing} ran a step and compared with one device:\n{summary}", pytrace=False
        )


@pytest.mark.slow  # the harness of the two runs above, beside them
def test_fuzz_harness_reports_mismatch_abort_and_hang(tmp_path):
    """The harness itself: a wrong gradient is a mismatch, a dying worker an abort,
    a stalled step a hang, and the worker is replaced after each."""
    env = _worker_env(None, tmp_path)
    base = {
        "mesh": {"data": 8},
        "plan": {},
        "model": {"kind": "plain", "d_in": 8, "d_out": 4, "hidden": 16, "depth": 1},
        "loss": "plain",
        "batch": {"size": 8, "seq": 8},
        "accumulate": 1,
    }
    worker = Worker(env, run_timeout=3)
    try:
        outcomes = []
        for i, what in enumerate([None, "mismatch", "abort", "hang", None]):
            if not worker.alive():
                worker.close()
                worker = Worker(env, run_timeout=3)
            spec = dict(base, id=i, **({"self_test": what} if what else {}))
            result = worker.run(spec)
            outcomes.append((result["outcome"], result.get("phase")))
    finally:
        worker.close()
    assert [o for o, _ in outcomes] == ["ok", "mismatch", "abort", "hang", "ok"], outcomes
    assert outcomes[2][1] == outcomes[3][1] == "run", outcomes


def _shrink(env):
    """Run the examples inside Hypothesis, one at a time, so that the first finding
    raises and Hypothesis shrinks it (local debugging; slow)."""
    holder = {}

    def worker():
        if "w" in holder and not holder["w"].alive():
            holder.pop("w").close()
        if "w" not in holder:
            holder["w"] = Worker(env)
        return holder["w"]

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(specs())
    def check(spec):
        spec = dict(spec, id=0)
        result = worker().run(spec)
        classes = finding_classes(result)
        assert not classes, f"{classes}\n{_command(spec, env=env)}\n{json.dumps(result)[:3000]}"

    try:
        check()
    finally:
        if "w" in holder:
            holder["w"].close()


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
