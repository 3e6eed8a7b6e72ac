"""eqxpar.inspect: sharding tables, communication and memory reports, layout
pictures. Expected numbers are counted by hand from the parameter shapes."""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import inspect as ei

from ._helpers import LogicalMLP, mse_loss

F32 = 4


def _setup(plan, model, d_out):
    """(step, state, batch, compiled step, plan) of an Adam step on `plan`."""
    optim = optax.adam(1e-2)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(mse_loss, optim, plan)
    batch = (jnp.ones((64, 16)), jnp.zeros((64, d_out)))
    return step, state, batch, step.compile(state, batch), plan


@pytest.fixture(scope="module")
def dp():
    # eqx.nn.MLP 16 -> 64 -> 64 -> 4, every weight replicated, batch over data=8.
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))
    return _setup(eqxpar.Plan(eqxpar.make_mesh(data=8)), model, 4)


@pytest.fixture(scope="module")
def fsdp():
    # w1 (16, 64) and w2 (64, 8) have >= 256 elements: split over fsdp=8 along
    # their 64-long dimension; b1 (64,) stays replicated.
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=256))
    return _setup(plan, LogicalMLP(16, 64, 8, key=jax.random.key(0)), 8)


# Gradient bytes of the two models, from their shapes.
DP_GRAD = (16 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4) * F32  # 22,032
FSDP_SHARDED = (16 * 64 + 64 * 8) * F32  # w1, w2: 6,144
FSDP_REPLICATED = 64 * F32  # b1: 256


def test_dp_comm_report_is_one_gradient_all_reduce(dp):
    step, state, batch, _, _ = dp
    report = ei.comm_report(step, state, batch)
    m = report.measured
    # One all-reduce; XLA fuses the 4-byte loss sum into the gradients' tuple.
    assert m.count == {"all-reduce": 1}
    assert m.bytes == {"all-reduce": DP_GRAD + F32}
    assert m.wire_bytes == {"all-reduce": 2 * 7 * (DP_GRAD + F32) // 8}
    # The minimum counts the gradients only (no scalars).
    assert report.minimum.bytes == {"all-reduce": DP_GRAD}
    assert report.minimum.wire_bytes == {"all-reduce": 2 * 7 * DP_GRAD // 8}
    assert report.ratio_to_minimum == (DP_GRAD + F32) / DP_GRAD
    assert report.baseline is None and report.ratio_to_baseline is None
    text = str(report)
    assert "all-reduce      1  22,036      38,563         0     22,032    38,556" in text
    assert "measured / minimum: 1.00x bytes, 1.00x wire bytes (minimum: data parallel over data=8" in text


def test_fsdp_comm_report_counts_gathers_and_gradient_reduction(fsdp):
    step, state, batch, compiled, _ = fsdp
    report = ei.comm_report(step, state, batch, baseline=compiled)
    m = report.measured
    # XLA:CPU gathers each sharded weight once (keeping it for the backward) and
    # all-reduces the full gradients before slicing out each shard (it makes no
    # reduce-scatter); the second all-reduce carries f32 scalars: the loss and
    # the gradient-norm partial sums of the two sharded gradients.
    assert m.count == {"all-gather": 2, "all-reduce": 2}
    assert m.bytes == {"all-gather": FSDP_SHARDED, "all-reduce": FSDP_SHARDED + FSDP_REPLICATED + 3 * F32}
    assert m.wire_bytes["all-gather"] == 7 * FSDP_SHARDED // 8
    # The minimum: gather once (the gathered weights kept for the backward pass, as
    # XLA does here), reduce-scatter the sharded gradients, all-reduce the replicated one.
    low = report.minimum
    assert low.bytes == {
        "all-gather": FSDP_SHARDED,
        "reduce-scatter": FSDP_SHARDED // 8,
        "all-reduce": FSDP_REPLICATED,
    }
    assert low.wire_bytes == {
        "all-gather": 7 * FSDP_SHARDED // 8,
        "reduce-scatter": 7 * (FSDP_SHARDED // 8),
        "all-reduce": 2 * 7 * FSDP_REPLICATED // 8,
    }
    assert report.wire_ratio_to_minimum == m.total_wire_bytes / low.total_wire_bytes
    # Baseline = the same compiled step: ratios exactly 1.
    assert report.ratio_to_baseline == 1.0 and report.wire_ratio_to_baseline == 1.0
    assert "reduce-scatter      0       0           0         0        768     5,376" in str(report)
    assert "measured / baseline: 1.00x bytes, 1.00x wire bytes" in str(report)


def test_minimum_for_hybrid_and_single_device_plans():
    model = LogicalMLP(16, 64, 8, key=jax.random.key(0))
    # data=2 x fsdp=4: gather over fsdp, reduce-scatter over fsdp, then the shards
    # (and the replicated bias) all-reduced over the rest of the batch devices.
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=256))
    low = ei.minimum_comm(plan, eqx.filter_eval_shape(lambda: model))
    assert low.bytes == {
        "all-gather": FSDP_SHARDED,
        "reduce-scatter": FSDP_SHARDED // 4,
        "all-reduce": FSDP_SHARDED // 4 + FSDP_REPLICATED,
    }
    assert low.wire_bytes["all-reduce"] == FSDP_SHARDED // 4 + 2 * 7 * FSDP_REPLICATED // 8
    # One data-parallel device: nothing must move.
    one = ei.minimum_comm(eqxpar.Plan(eqxpar.make_mesh(tensor=8)), model)
    assert one.total_bytes == 0 and one.total_wire_bytes == 0


def test_comm_report_of_compiled_and_given_minimum(dp):
    _, _, _, compiled, _ = dp
    bare = ei.comm_report(compiled)
    assert bare.minimum is None and bare.ratio_to_minimum is None
    assert "n/a" in str(bare) and "pass minimum=" in str(bare)
    given = ei.comm_report(compiled, minimum=DP_GRAD // 2, baseline=ei.collective_stats(compiled))
    assert given.ratio_to_minimum == (DP_GRAD + F32) / (DP_GRAD // 2)
    assert given.wire_ratio_to_minimum is None  # only result bytes were given
    assert "measured / minimum: 2.00x bytes, n/a wire bytes (given: result bytes)" in str(given)


def test_tensor_parallel_minimum_needs_the_loss_and_batch():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.Logical({"mlp": "tensor"}))
    model = LogicalMLP(16, 64, 8, key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match=r"splits weights over the tensor axis.*Pass loss=.*batch="):
        ei.minimum_comm(plan, model)


@pytest.mark.parametrize("which", ["dp", "fsdp"])
def test_table_bytes_per_device_equal_compiled_arguments(which, request):
    step, state, batch, compiled, plan = request.getfixturevalue(which)
    # The step's arguments are the state's array leaves (model, optimizer
    # moments and count, step, key) in their shardings, and the batch split over
    # the batch axes; XLA's argument size is their bytes on one device, exactly.
    table = ei.sharding_table(state, plan)
    outline = ei.sharding_table(eqx.filter_eval_shape(lambda: state), plan)
    batch_table = ei.sharding_table(batch, plan, specs=plan.batch_spec)
    assert outline == table
    assert batch_table.bytes_per_device == (64 * 16 + 64 * (4 if which == "dp" else 8)) * F32 // 8
    expected = compiled.memory_analysis().argument_size_in_bytes
    assert table.bytes_per_device + batch_table.bytes_per_device == expected


def test_table_rows_and_text(fsdp):
    _, state, _, _, plan = fsdp
    table = ei.sharding_table(state.model, plan)
    w1, b1, w2 = table.rows
    assert (w1.path, w1.shape, w1.dtype, w1.axes, w1.spec) == (
        ".w1",
        (16, 64),
        "float32",
        ("embed", "mlp"),
        P(None, "fsdp"),
    )
    assert (w1.split, w1.bytes, w1.bytes_per_device) == (8, 16 * 64 * F32, 16 * 8 * F32)
    assert (b1.spec, b1.bytes_per_device) == (P(), 64 * F32)
    assert (w2.spec, w2.bytes_per_device) == (P("fsdp", None), 8 * 8 * F32)
    assert table.bytes == FSDP_SHARDED + FSDP_REPLICATED
    assert table.bytes_per_device == FSDP_SHARDED // 8 + FSDP_REPLICATED
    assert str(table) == "\n".join(
        [
            "path                           shape     dtype    logical axes      spec             bytes  per device",
            "-----------------------------  --------  -------  ----------------  ---------------  -----  ----------",
            ".w1                            (16, 64)  float32  ('embed', 'mlp')  P(None, 'fsdp')  4,096         512",
            ".b1                            (64,)     float32  ('mlp',)          P()                256         256",
            ".w2                            (64, 8)   float32  ('mlp', 'embed')  P('fsdp', None)  2,048         256",
            "total (3 arrays, mesh fsdp=8)                                                        6,400       1,024",
        ]
    )


def test_memory_report(dp):
    step, state, batch, compiled, _ = dp
    report = ei.memory_report(step, state, batch)
    stats = compiled.memory_analysis()
    assert report == ei.memory_report(compiled)
    assert report.argument_bytes == stats.argument_size_in_bytes
    assert report.alias_bytes == stats.alias_size_in_bytes > 0  # the state is donated
    assert report.total == (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.generated_code_size_in_bytes
    )
    rows = {line[:14].strip(): line[14:].split() for line in str(report).splitlines()[3:]}
    assert rows["arguments"][0] == f"{stats.argument_size_in_bytes:,}"
    assert rows["aliased"][0] == f"-{stats.alias_size_in_bytes:,}"
    assert rows["total"] == [f"{report.total:,}", "per", "device"]


MESH_2x4 = dict(data=2, tensor=4)


def _placed(spec, shape):
    mesh = eqxpar.make_mesh(**MESH_2x4)
    return jax.device_put(jnp.zeros(shape), NamedSharding(mesh, spec))


def test_layout_replicated():
    assert ei.layout(_placed(P(), (8, 8))) == "\n".join(
        [
            "float32[8,8]  P()  mesh data=2 x tensor=4",
            "       0:8",
            "    +-------+",
            "0:8 |  0-7  |",
            "    +-------+",
        ]
    )


def test_layout_one_axis_and_1d():
    assert ei.layout(_placed(P("data"), (8, 8))) == "\n".join(
        [
            "float32[8,8]  P('data')  mesh data=2 x tensor=4",
            "       0:8",
            "    +-------+",
            "0:4 |  0-3  |",
            "    +-------+",
            "4:8 |  4-7  |",
            "    +-------+",
        ]
    )
    # 1-D: one row of blocks; each block on one device of every data replica.
    assert ei.layout(_placed(P("tensor"), (16,))) == "\n".join(
        [
            "float32[16]  P('tensor')  mesh data=2 x tensor=4",
            "    0:4       4:8       8:12     12:16",
            "+---------+---------+---------+---------+",
            "|   0,4   |   1,5   |   2,6   |   3,7   |",
            "+---------+---------+---------+---------+",
        ]
    )


def test_layout_2d_split_and_bare_sharding():
    assert ei.layout(_placed(P("data", "tensor"), (8, 8))) == "\n".join(
        [
            "float32[8,8]  P('data', 'tensor')  mesh data=2 x tensor=4",
            "       0:2     2:4     4:6     6:8",
            "    +-------+-------+-------+-------+",
            "0:4 |   0   |   1   |   2   |   3   |",
            "    +-------+-------+-------+-------+",
            "4:8 |   4   |   5   |   6   |   7   |",
            "    +-------+-------+-------+-------+",
        ]
    )
    sharding = NamedSharding(eqxpar.make_mesh(**MESH_2x4), P("tensor", "data"))
    lines = ei.layout(sharding, (8, 4)).splitlines()
    assert lines[0] == "shape (8, 4)  P('tensor', 'data')  mesh data=2 x tensor=4"
    assert lines[3] == "0:2 |   0   |   4   |" and lines[-2] == "6:8 |   3   |   7   |"
    # Rank 3: drawn by the first two dims, with a note.
    outline = jax.ShapeDtypeStruct((4, 8, 2), jnp.float32, sharding=sharding)
    assert ei.layout(outline).splitlines()[-1].startswith("(dims 0-1 of shape (4, 8, 2)")


def test_save_layout_png(tmp_path):
    path = ei.save_layout_png(_placed(P("data", "tensor"), (8, 8)), tmp_path / "layout.png")
    assert path == tmp_path / "layout.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_optional_dependencies_missing(monkeypatch, tmp_path, dp):
    _, state, _, _, plan = dp
    table = ei.sharding_table(state.model, plan)
    # A None entry in sys.modules makes `import` raise ImportError: as if missing.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches", "rich", "rich.table"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(eqxpar.EqxparError, match=r"pip install eqxpar\[examples\]"):
        ei.save_layout_png(_placed(P(), (8, 8)), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(eqxpar.EqxparError, match=r"pip install rich.*str\(table\)"):
        table.rich()


def test_bad_input_errors(dp):
    step, state, batch, compiled, plan = dp
    with pytest.raises(eqxpar.PlanError, match=r"plan='data'.*eqxpar\.Plan"):
        ei.sharding_table(state, "data")
    with pytest.raises(eqxpar.EqxparError, match=r"tree=dict .*no array leaves.*TrainState"):
        ei.sharding_table({"lr": 0.1, "act": jax.nn.relu}, plan)
    with pytest.raises(eqxpar.EqxparError, match=r"specs=\[.*pytree of PartitionSpecs"):
        ei.sharding_table(batch, plan, specs=[P()])
    with pytest.raises(eqxpar.EqxparError, match=r"comm_report\(str 'step'\).*eqxpar\.train\.make_step"):
        ei.comm_report("step")
    with pytest.raises(
        eqxpar.EqxparError, match=r"exactly 2 more arguments, got 1.*comm_report\(step, state, batch\)"
    ):
        ei.comm_report(step, state)
    with pytest.raises(eqxpar.EqxparError, match=r"memory_report\(Compiled, \.\.\.\).*got 1"):
        ei.memory_report(compiled, batch)
    with pytest.raises(eqxpar.EqxparError, match=r"memory_report\(int 42\)"):
        ei.memory_report(42)
    with pytest.raises(eqxpar.EqxparError, match=r"minimum='lots'.*Minimum"):
        ei.comm_report(compiled, minimum="lots")
    with pytest.raises(eqxpar.EqxparError, match=r"baseline='gspmd'.*jax\.stages\.Compiled"):
        ei.comm_report(compiled, baseline="gspmd")
    sharding = NamedSharding(plan.mesh, P("data"))
    with pytest.raises(eqxpar.EqxparError, match=r"a sharding alone has no shape.*shape=\(rows, cols\)"):
        ei.layout(sharding)
    with pytest.raises(eqxpar.EqxparError, match=r"shape=\(8, 8\).*own shape \(8, 8\). Drop shape="):
        ei.layout(_placed(P(), (8, 8)), (8, 8))
    with pytest.raises(eqxpar.EqxparError, match=r"carries no sharding.*ShapeDtypeStruct"):
        ei.layout(jax.ShapeDtypeStruct((8,), jnp.float32))
