"""The advisor's TPU model held to the TPU compiler's own figures.

`benchmarks/results/quick.json` holds what the TPU compiler made of published
models on v5p slices (`python -m benchmarks.tpu_compile`, libtpu ahead of time):
per-device argument and temporary bytes and the collectives' wire bytes. Each
case here predicts the same plan again from shapes with today's code (nothing
compiled: a few seconds) and checks it against those compiled figures.

The goal is 10 % on memory and 5 % on wire. The wire meets it on every
record (each collective the compiled program runs, `eqxpar/_advise/_tpu.py`),
HSDP's over two and four slices included; the memory on three. On 8B FSDP 32
and 70B FSDP 32 x tensor 4, libtpu 0.0.50.1 (the records' compiler) reports
temporaries beyond its own buffer assignment (1.33 and 3.10 GiB, which no
buffer of the HLO program holds; libtpu 0.0.52 reports its heap alone, and the
prediction is within 5 % of it on both). Those two, and the HSDP records (whose
gradients the compiler all-reduces whole inside the slice), are held to today's
error, so that the model cannot drift further unnoticed (BENCHMARKS.md, the
compile-ahead guide).
"""

import importlib.util
import json
import pathlib

import pytest

from benchmarks import tpu_compile

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to lay the meshes over',
)

RECORDS = json.loads((pathlib.Path(tpu_compile.RESULTS) / "quick.json").read_text())["tpu_compile"]

#: (memory, wire) bound per record beside MaxText's: the relative error of the prediction.
BOUNDS = {
    "llama3-8b_v5p-64_fsdp32": (0.24, 0.05),
    # The query, key and value projections saved (the activations' offload's
    # base): the same excess over the buffers as the plain case (their heap: 1 %).
    "llama3-8b_v5p-64_fsdp32_save-activations": (0.22, 0.05),
    "llama3-8b_v5p-64_fsdp8_tensor4": (0.10, 0.05),
    "llama3-70b_v5p-256_fsdp32_tensor4": (0.22, 0.05),
    "llama3-70b_v5p-256_pipe4_fsdp32": (0.10, 0.05),
    "mixtral-8x7b_v5p-128_expert8_fsdp8": (0.10, 0.01),
    # HSDP over two and four slices: the compiler all-reduces the gradients inside
    # the slice where it reduce-scatters them in one (`_tpu`, "Over several
    # slices"); the memory, whose gradients the model keeps split, at today's error.
    "llama3-8b_2xv5p-64_data2_fsdp32": (0.34, 0.01),
    "llama3-8b_4xv5p-64_data4_fsdp32": (0.34, 0.01),
}


@pytest.mark.parametrize("name", [n for n in BOUNDS if n in RECORDS and not RECORDS[n].get("refused")])
def test_the_tpu_prediction_matches_the_tpu_compilers_record(name):
    record = RECORDS[name]
    p = tpu_compile.predict_case(name)
    assert p["argument_bytes"] == pytest.approx(record["argument_bytes"], rel=0.01)
    memory = record["argument_bytes"] + record["temp_bytes"]
    memory_bound, wire_bound = BOUNDS[name]
    assert abs((p["argument_bytes"] + p["temp_bytes"]) / memory - 1) <= memory_bound, (p, memory)
    assert abs(p["wire_bytes"] / record["total_wire_bytes"] - 1) <= wire_bound, (
        p,
        record["total_wire_bytes"],
    )


def test_the_cpu_profile_keeps_every_gradient_whole_where_the_tpu_scatters_them():
    # The same plan predicted for XLA:CPU and for the TPU compiler: automatic FSDP's
    # gradients whole per device (30 GB on 8B) against their shards.
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqxpar
    from eqxpar import aot
    from eqxpar._advise._analysis import analyse
    from eqxpar._advise._predict import predict

    config = eqxpar.models.preset("llama3-8b", num_layers=2)
    plan = aot.plan_of({"fsdp": 32}, topology="v5p-64")
    outline = eqx.filter_eval_shape(eqxpar.models.GPT, config, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((32, 2049), jnp.int32)
    state = eqxpar.train.init(outline, optax.adamw(1e-4), plan, key=jax.random.key(0), abstract=True)
    with plan:
        analysis = analyse(outline, eqxpar.models.lm_loss, tokens)
    run = lambda device: predict(  # noqa: E731
        plan,
        state.model,
        state.opt_state,
        tokens,
        eqxpar.models.lm_loss,
        analysis,
        eqxpar.DEVICE_PROFILES[device],
    )
    cpu, tpu = run("cpu"), run("tpu_v5p")
    assert tpu.gradient_bytes == tpu.params_bytes
    assert cpu.gradient_bytes == 32 * tpu.params_bytes
    # The TPU reduce-scatters in bfloat16 what XLA:CPU all-reduces in float32
    # (it widens bfloat16 sums): a quarter of the wire bytes; but for the
    # embedding, whose lookup moves its table's shard by all-to-all instead.
    assert "reduce-scatter" not in cpu.wire_bytes and "all-reduce" not in tpu.wire_bytes
    table = config.vocab_size * config.d_model * 2 * 31 // 32
    assert 4 * (tpu.wire_bytes["reduce-scatter"] + table) == pytest.approx(
        cpu.wire_bytes["all-reduce"], rel=1e-3
    )
    assert tpu.wire_bytes["all-to-all"] > 0


def test_a_remat_policys_named_values_are_kept_per_layer_and_offloaded_but_one_layers():
    # Under a RematPolicy the stack keeps each layer's named values beside its
    # input (saved: on the device; offloaded: in host memory, but one layer's
    # transfer buffers), every layer's: Llama-3-8B's shapes, 2 layers, on the
    # TPU profile.
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqxpar
    from eqxpar import aot
    from eqxpar._advise._analysis import analyse
    from eqxpar._advise._predict import predict

    qkv = ("query_proj", "key_proj", "value_proj")
    config = eqxpar.models.preset("llama3-8b", num_layers=2, loss_chunk=512)
    outline = eqx.filter_eval_shape(eqxpar.models.GPT, config, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((32, 2049), jnp.int32)
    options = {
        "full": {},
        "saved": dict(saved_names=qkv),
        "offloaded": dict(offload=("activations",), offloaded_names=qkv),
    }
    p = {}
    for label, kw in options.items():
        plan = aot.plan_of({"fsdp": 32}, topology="v5p-64", **kw)
        state = eqxpar.train.init(outline, optax.adamw(1e-4), plan, key=jax.random.key(0), abstract=True)
        with plan:
            analysis = analyse(outline, eqxpar.models.lm_loss, tokens)
        profile = eqxpar.DEVICE_PROFILES["tpu_v5p"]
        p[label] = predict(
            plan, state.model, state.opt_state, tokens, eqxpar.models.lm_loss, analysis, profile
        )
    # One layer's query, key and value per chip: 2,048 tokens x (4,096 + 2 x 1,024) in bfloat16.
    layer = 2048 * (4096 + 2 * 1024) * 2
    assert p["saved"].temp_bytes - p["full"].temp_bytes == 2 * layer
    assert p["offloaded"].host_bytes == 2 * layer
    assert p["saved"].temp_bytes - p["offloaded"].temp_bytes == 2 * layer - layer


#: Per offload record: the bounds on the error of what the offload changes on
#: the device (arguments + temporaries, this record against the one it offloads
#: from), as a share of what it offloads: on `memory_analysis()`'s temporaries,
#: and on the buffer assignment's own (`heap_temp_bytes`, None: not held). The
#: goal is 10 %. libtpu 0.0.50.1's temporaries carry an excess over its buffer
#: assignment (tests above), and the offload changes it: the activations' heap
#: falls by 0.73 GiB against the same names saved, and the excess by 0.30 more
#: (the advisor counts the buffers: +1 % on the heap, +41 % on the reported
#: figure); the parameters' heap falls by 0.11 GiB, the excess by 0.70 (the
#: advisor's term, the stacked gradients off the device and the weights outside
#: the stack whole on it, follows the reported figure: 14 %).
OFFLOAD_BOUNDS = {
    "llama3-8b_v5p-64_fsdp32_offload-optimizer": (0.10, None),
    "llama3-8b_v5p-64_fsdp32_offload-params": (0.20, None),
    "llama3-70b_v5p-256_fsdp32_tensor4_offload-optimizer": (0.10, None),
    "llama3-8b_v5p-64_fsdp32_offload-activations": (0.45, 0.10),
}


@pytest.mark.parametrize("name", [n for n in OFFLOAD_BOUNDS if n in RECORDS])
def test_the_offload_prediction_matches_the_tpu_compilers_record(name):
    # Host bytes within 10 %; on the device, what the offload changes, within
    # its bounds. The plain prediction's own error is the plain record's (above).
    base = tpu_compile.OFFLOAD_CASES[name][0]
    record, plain = RECORDS[name], RECORDS[base]
    offloaded = record["host_argument_bytes"] or record["host_bytes"]
    # The record itself meets the bar: the peak falls by 90 % of what is
    # offloaded (the streamed update, the stack's weights moved a layer at a
    # time, the projections against the same names saved; a rerun that
    # regresses fails here).
    assert plain["peak_bytes"] - record["peak_bytes"] >= 0.9 * offloaded
    p, q = tpu_compile.predict_case(name), tpu_compile.predict_case(base)
    assert p["host_bytes"] == pytest.approx(record["host_bytes"], rel=0.10)
    predicted = p["argument_bytes"] + p["temp_bytes"] - q["argument_bytes"] - q["temp_bytes"]
    reported, heap = OFFLOAD_BOUNDS[name]
    compiled = record["argument_bytes"] + record["temp_bytes"] - plain["argument_bytes"] - plain["temp_bytes"]
    assert abs(predicted - compiled) <= reported * offloaded, (predicted, compiled)
    if heap is not None:
        buffers = (
            record["argument_bytes"]
            + record["heap_temp_bytes"]
            - plain["argument_bytes"]
            - plain["heap_temp_bytes"]
        )
        assert abs(predicted - buffers) <= heap * offloaded, (predicted, buffers)
