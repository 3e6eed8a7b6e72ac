"""Every bad input the foundation can catch raises an eqxpar error naming the
value and the fix, before any XLA error. One test per case."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.rules import ByPath, Logical

from ._helpers import LogicalMLP, mse_loss, regression_batches


def test_errors_share_one_base_class():
    for cls in (
        eqxpar.MeshError,
        eqxpar.AxisNameError,
        eqxpar.SpecError,
        eqxpar.DivisibilityError,
        eqxpar.BatchError,
        eqxpar.UnmatchedLeafError,
        eqxpar.PlanError,
    ):
        assert issubclass(cls, eqxpar.EqxparError)


def test_mesh_larger_than_devices():
    with pytest.raises(eqxpar.MeshError, match=r"data=16 needs 16 devices but only 8 .* at most 8"):
        eqxpar.make_mesh(data=16)


def test_unknown_axis_in_logical_rule():
    with pytest.raises(
        eqxpar.AxisNameError,
        match=r"'model'.*mesh has axes \('data', 'pipe', 'fsdp', 'expert', 'context', 'tensor'\)",
    ):
        eqxpar.Plan(eqxpar.make_mesh(data=8), rules=Logical({"mlp": "model"}))


def test_unknown_axis_in_path_rule():
    with pytest.raises(eqxpar.AxisNameError, match="'tp'"):
        eqxpar.Plan(eqxpar.make_mesh(data=8), rules=ByPath([("weight", P("tp"))]))


def test_unknown_axis_in_explicit_spec():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    with pytest.raises(eqxpar.AxisNameError, match=r"mesh axis 'batch'"):
        eqxpar.shard(jnp.zeros((8, 4)), plan, specs=P("batch"))


def test_unknown_axis_in_annotation():
    with pytest.raises(eqxpar.AxisNameError, match=r"annotation 'hidden'.*'model'"):
        eqxpar.Plan(eqxpar.make_mesh(data=8), annotations={"hidden": P(None, "model")})


def dp_step(data, *, accumulate=1):
    """A small data-parallel state and step on `data` devices."""
    model = eqx.nn.MLP(16, 4, 8, 1, key=jax.random.key(0))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=data))
    state = eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(0))
    return plan, state, eqxpar.train.make_step(mse_loss, optax.sgd(0.1), plan, accumulate=accumulate)


def test_batch_not_divisible_by_data_parallel_size():
    plan, state, step = dp_step(8)
    x, y = regression_batches(1, batch=12)[0]
    with pytest.raises(
        eqxpar.BatchError,
        match=r"batch size 12 is not divisible by the 8 data-parallel.*multiple of 8: the nearest are 8 and 16",
    ):
        step(state, (x, y))
    with pytest.raises(eqxpar.BatchError, match="batch size 12"):
        eqxpar.shard_batch((x, y), plan)


def test_microbatches_not_dividing_the_batch():
    _, state, step = dp_step(2, accumulate=3)
    with pytest.raises(eqxpar.BatchError, match=r"batch size 32 is not divisible by the 3 micro-batches"):
        step(state, regression_batches(1)[0])


def test_micro_batch_not_divisible_by_data_parallel_size():
    # The message names the batch the user passed and what cut it, not only the
    # micro-batch size it derived.
    _, state, step = dp_step(8, accumulate=8)
    with pytest.raises(
        eqxpar.BatchError,
        match=r"batch size 32, cut into the 8 micro-batches of accumulate=8, gives micro-batches of 4 rows"
        r".*8 data-parallel devices.*multiple of 64 \(8 micro-batches x 8 devices\): the nearest is 64; "
        r"or a micro-batch count that fits it \(4\)",
    ):
        step(state, regression_batches(1)[0])


def test_batch_errors_name_the_batch_the_micro_batches_and_the_nearest_sizes():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2))
    step = eqxpar.train.make_value_and_grad(mse_loss, plan, accumulate=4)
    model = eqx.nn.MLP(16, 4, 8, 1, key=jax.random.key(0))
    with pytest.raises(
        eqxpar.BatchError,
        match=r"^batch size 12, cut into the 4 micro-batches of accumulate=4, gives micro-batches of 3 rows, "
        r"which are not divisible by the 2 data-parallel devices .*multiple of 8 \(4 micro-batches x 2 "
        r"devices\): the nearest are 8 and 16; or a micro-batch count that fits it \(3 or 6\)\.$",
    ):
        step(model, regression_batches(1, batch=12)[0])
    with pytest.raises(
        eqxpar.BatchError,
        match=r"^batch size 10 is not divisible by the 4 micro-batches of accumulate=4\. .*multiple of 8 .*"
        r"the nearest are 8 and 16; or a micro-batch count that fits it \(1 or 5\)\.$",
    ):
        step(model, regression_batches(1, batch=10)[0])


def test_spec_longer_than_rank():
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4), rules=ByPath([("bias", P(None, "tensor"))], strict=False)
    )
    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    with pytest.raises(eqxpar.SpecError, match=r"leaf \.bias: spec .* 2 entries but the array has rank 1"):
        eqxpar.partition_specs(model, plan)


def test_logical_axes_of_wrong_length():
    class Bad(eqx.Module):
        w: jax.Array = eqxpar.param(axes=("embed",))

    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    with pytest.raises(eqxpar.SpecError, match=r"leaf \.w: .*\('embed',\).*rank 2"):
        eqxpar.partition_specs(Bad(jnp.zeros((4, 4))), plan)


def test_dimension_not_divisible_by_mesh_axis():
    model = LogicalMLP(6, 16, 6, key=jax.random.key(0))
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=4, tensor=2), rules=Logical({"embed": "fsdp"}))
    with pytest.raises(eqxpar.DivisibilityError, match=r"leaf \.w1: dimension 0 .* size 6, .* 4 devices"):
        eqxpar.partition_specs(model, plan)


def test_strict_path_rule_with_unmatched_leaf():
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), rules=ByPath([(r"weight$", P())], strict=True))
    with pytest.raises(eqxpar.UnmatchedLeafError, match=r"path '\.layers\[0\]\.bias'"):
        eqxpar.partition_specs(model, plan)


def test_bad_plan_mode():
    with pytest.raises(eqxpar.PlanError, match="'sync'"):
        eqxpar.Plan(eqxpar.make_mesh(data=8), mode="sync")


def test_manual_mode_rejects_weights_split_over_a_non_batch_axis():
    # Batch axes are gathered (manual FSDP) and tensor is the layers'; nothing
    # gathers a weight split over `pipe` outside a pipeline schedule.
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, pipe=2), rules=Logical({"mlp": "pipe"}), mode="manual")
    state = eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(mse_loss, optax.sgd(0.1), plan)
    with pytest.raises(eqxpar.PlanError, match="over manual axis 'pipe'"):
        step(state, regression_batches(1, d_in=8, d_out=8)[0])


def test_manual_mode_rejects_equinox_layer_weights_split_over_tensor():
    # eqx.nn.Linear computes on whole weights: a rule splitting its weight over a
    # manual tensor axis is a plan error, not a dot_general shape error (plan fuzz).
    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4),
        rules=ByPath([(r"weight$", P(None, "tensor"))], strict=False),
        mode="manual",
        manual_axes=("data", "tensor"),
    )
    state = eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(mse_loss, optax.sgd(0.1), plan)
    with pytest.raises(
        eqxpar.PlanError, match=r"layers\[0\]\.weight .*equinox's Linear.*P\(None, 'tensor'\)"
    ):
        step(state, regression_batches(1, d_in=8, d_out=4)[0])


def test_filter_shard_map_wrong_number_of_specs():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    f = eqxpar.filter_shard_map(lambda a, b: a, plan, in_specs=(P(),), out_specs=P())
    with pytest.raises(eqxpar.PlanError, match="in_specs has 1 entries .* 2 positional"):
        f(jnp.zeros(8), jnp.zeros(8))


def test_cpu_collective_order_warning(monkeypatch):
    # Manual over fsdp and tensor on XLA:CPU needs the in-order collective flag
    # (set by conftest); without it make_step says how to set it.
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=2, tensor=4), mode="manual", manual_axes=("fsdp", "tensor"))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(RuntimeWarning, match="xla_cpu_enable_concurrency_optimized_scheduler=false"):
        eqxpar.train.make_step(lambda m, b: jnp.mean(b), optax.sgd(0.1), plan)
    # One manual axis, or an automatic plan: no warning.
    for quiet in (
        eqxpar.Plan(eqxpar.make_mesh(fsdp=2, tensor=4), mode="manual", manual_axes=("tensor",)),
        eqxpar.Plan(eqxpar.make_mesh(fsdp=2, tensor=4)),
    ):
        eqxpar.train.make_step(lambda m, b: jnp.mean(b), optax.sgd(0.1), quiet)
