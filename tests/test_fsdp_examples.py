"""The FSDP and hybrid examples run from the command line for a couple of steps,
on a tiny model, in several of their modes; and their flags build the plans they
describe, splitting the parameters and optimizer state as they say (checked on
shapes only, nothing compiled)."""

import importlib
import pathlib
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar

from ._helpers import run_example

ROOT = pathlib.Path(__file__).parent.parent

# A tiny model and a couple of steps: these check that every mode builds, shards,
# trains and reports, not that it learns (the default runs show that).
TINY = [
    "--steps",
    "2",
    "--eval-every",
    "2",
    "--batch-size",
    "8",
    "--seq-len",
    "16",
    "--d-model",
    "32",
    "--layers",
    "1",
]

CASES = [
    ("fsdp.py", []),
    ("fsdp.py", ["--mode", "manual", "--remat", "inputs"]),
    ("fsdp.py", ["--zero1"]),
    ("hybrid.py", []),
    ("hybrid.py", ["--mode", "partial", "--sequence-parallel"]),
    ("hybrid.py", ["--mode", "manual", "--bf16", "--remat", "dots"]),
]


@pytest.mark.parametrize("script,args", CASES, ids=[" ".join([s, *a]) for s, a in CASES])
def test_fsdp_example_runs(script, args):
    # Two steps of a tiny model: compilation dominates, so compile cheaply (the
    # example adds the device count to these flags).
    result = run_example(script, [*TINY, *args], xla_flags="--xla_backend_optimization_level=0")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "per device of" in out
    final = re.search(r"final eval loss ([0-9.]+) nats/char \(unigram entropy ([0-9.]+)\)", out)
    assert final, out[-2000:]
    assert 0 < float(final.group(1)) < 10
    assert "collectives per step" in out


@pytest.fixture(scope="module")
def examples():
    """The example modules, imported in this process (the test session already has
    8 devices) for their plans: nothing is compiled."""
    path = str(ROOT / "examples")
    sys.path.insert(0, path)
    try:
        yield tuple(importlib.import_module(name) for name in ("_model", "fsdp", "hybrid"))
    finally:
        sys.path.remove(path)


def _per_device_fraction(model_module, plan):
    """Bytes each device holds over the total, for the default model and AdamW."""

    def build():
        model = model_module.CharLM(
            96, 64, d_model=64, num_heads=4, d_hidden=256, num_layers=2, key=jax.random.key(0)
        )
        return eqxpar.train.TrainState(
            model=model,
            opt_state=optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array)),
            step=jnp.zeros((), jnp.int32),
            key=jax.random.key(1),
        )

    state = eqx.filter_eval_shape(build)  # shapes only
    table = eqxpar.inspect.sharding_table(state, plan)
    model_rows = [r for r in table.rows if r.path.startswith(".model")]
    return (
        sum(r.bytes_per_device for r in model_rows) / sum(r.bytes for r in model_rows),
        table.bytes_per_device / table.bytes,
    )


@pytest.mark.parametrize(
    "flags,mesh,params_split,split",
    [
        ([], {"fsdp": 8}, 8, 8),
        (["--hsdp", "--mode", "manual"], {"data": 2, "fsdp": 4}, 4, 4),
        (["--zero1"], {"data": 8}, 1, None),  # parameters whole, moments (2/3 of it) split
    ],
    ids=["fsdp", "hsdp", "zero1"],
)
def test_fsdp_plans_split_what_they_say(examples, flags, mesh, params_split, split):
    model_module, fsdp, _ = examples
    plan = fsdp.make_plan(fsdp.parse_args(flags))
    assert {k: v for k, v in plan.mesh.shape.items() if v > 1} == mesh
    params, together = _per_device_fraction(model_module, plan)
    # Small leaves (norm scales, the position table) stay whole: allow 25% over 1/n.
    assert 1 / params_split <= params <= 1.25 / params_split
    if split is not None:
        assert 1 / split <= together <= 1.25 / split
    else:
        assert 1 / 3 + 2 / 3 / 8 <= together <= 1.1 * (1 / 3 + 2 / 3 / 8)


@pytest.mark.parametrize(
    "flags,expected",
    [
        ([], dict(mode="auto", manual_axes=())),
        (["--mode", "manual"], dict(mode="manual", manual_axes=("data", "pipe", "fsdp", "tensor"))),
        (["--mode", "partial", "--sequence-parallel"], dict(manual_axes=("tensor",), sequence_parallel=True)),
        (["--bf16", "--remat", "dots"], dict(compute_dtype=jnp.dtype(jnp.bfloat16), remat="dots")),
    ],
    ids=["auto", "manual", "partial-sp", "bf16-dots"],
)
def test_hybrid_plans(examples, flags, expected):
    model_module, _, hybrid = examples
    plan = hybrid.make_plan(hybrid.parse_args(flags))
    assert dict(plan.mesh.shape) == {"data": 2, "pipe": 1, "fsdp": 2, "tensor": 2}
    assert plan.rules == (eqxpar.rules.MEGATRON_FSDP,)
    for name, value in expected.items():
        assert getattr(plan, name) == value, name
    params, together = _per_device_fraction(model_module, plan)
    assert 1 / 4 <= params <= 1.25 / 4 and 1 / 4 <= together <= 1.25 / 4
