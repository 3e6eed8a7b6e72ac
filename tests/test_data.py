"""eqxpar.data: process slices, global batches and the resumable per-process iterator.

These run in one process (8 devices); tests/test_launch.py checks the same code
across 2 processes, where each feeds half of every global batch.
"""

import json

import jax
import numpy as np
import pytest

import eqxpar
from eqxpar import BatchError
from eqxpar.data import ShardedIterator, global_batch, process_slice


def _dataset(n=100):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32), "y": np.arange(n, dtype=np.int32)}


def test_process_slice_and_global_batch_in_one_process():
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=4, tensor=2))
    assert process_slice(16, plan) == slice(0, 16)
    data = _dataset(16)
    batch = global_batch(data, plan)
    for name in data:
        assert batch[name].shape == data[name].shape
        assert batch[name].sharding == plan.sharding(plan.batch_spec)
        np.testing.assert_array_equal(np.asarray(batch[name]), data[name])
        # Each device holds 16 / 4 rows (fsdp), replicated over tensor.
        assert {s.data.shape[0] for s in batch[name].addressable_shards} == {4}
    reference = eqxpar.shard_batch(data, plan)
    assert batch["x"].sharding == reference["x"].sharding


def test_global_batch_and_slice_errors():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    with pytest.raises(BatchError, match=r"global batch size 12 is not divisible by the 8"):
        process_slice(12, plan)
    with pytest.raises(BatchError, match="expected an integer >= 1"):
        process_slice(0, plan)
    with pytest.raises(BatchError, match=r"different row counts \[8, 16\]"):
        global_batch((np.zeros((16, 2)), np.zeros((8,))), plan)
    with pytest.raises(BatchError, match="scalar"):
        global_batch({"x": np.zeros((8, 2)), "t": np.float32(1.0)}, plan)
    with pytest.raises(BatchError, match=r"has 12 rows.*multiple of 8.*process_slice"):
        global_batch(np.zeros((12, 2)), plan)
    with pytest.raises(BatchError, match="no array leaves"):
        global_batch({}, plan)


def test_iterator_is_deterministic_covers_each_epoch_and_ignores_the_mesh():
    data = _dataset(100)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    a = ShardedIterator(data, plan, batch_size=16, seed=3)
    b = ShardedIterator(data, plan, batch_size=16, seed=3)
    assert a.steps_per_epoch == 6
    epoch = []
    for _ in range(6):
        x, y = next(a), next(b)
        np.testing.assert_array_equal(x["x"], y["x"])
        np.testing.assert_array_equal(x["y"], y["y"])
        np.testing.assert_array_equal(x["x"], data["x"][x["y"]])  # rows stay aligned across leaves
        epoch.extend(x["y"].tolist())
    assert len(set(epoch)) == 96  # no example twice within an epoch
    assert not np.array_equal(next(a)["y"], np.asarray(epoch[:16]))  # epoch 2 has its own order
    other_seed = ShardedIterator(data, plan, batch_size=16, seed=4)
    assert not np.array_equal(next(other_seed)["y"], np.asarray(epoch[:16]))
    ordered = ShardedIterator(data, plan, batch_size=16, shuffle=False)
    np.testing.assert_array_equal(next(ordered)["y"], np.arange(16))
    # The global batch of a step does not depend on the mesh or the process count.
    other_plan = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4))
    c = ShardedIterator(data, other_plan, batch_size=16, seed=3)
    for step in (0, 5, 6, 13):
        np.testing.assert_array_equal(c.global_indices(step), a.global_indices(step))


def test_iterator_resumes_from_its_json_state():
    data = _dataset(100)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    run = ShardedIterator(data, plan, batch_size=16, seed=1)
    for _ in range(8):
        next(run)
    state = json.loads(json.dumps(run.get_state()))
    assert state == {"step": 8, "seed": 1}
    expected = [next(run)["y"] for _ in range(5)]
    resumed = ShardedIterator(data, plan, batch_size=16, seed=999)
    resumed.set_state(state)
    assert resumed.step == 8
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["y"], want)
    started_there = ShardedIterator(data, plan, batch_size=16, seed=1, step=8)
    np.testing.assert_array_equal(next(started_there)["y"], expected[0])
    # Its batches feed a train step as global batches.
    batch = global_batch(next(started_there), plan)
    assert isinstance(batch["x"], jax.Array) and batch["x"].shape == (16, 3)


def test_iterator_errors():
    data = _dataset(20)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    with pytest.raises(BatchError, match=r"batch_size=24 is larger than the dataset \(20 examples\)"):
        ShardedIterator(data, plan, batch_size=24)
    with pytest.raises(BatchError, match="not divisible by the 8"):
        ShardedIterator(data, plan, batch_size=12)
    with pytest.raises(BatchError, match=r"different example counts \[10, 20\]"):
        ShardedIterator({"x": data["x"], "y": data["y"][:10]}, plan, batch_size=8)
    with pytest.raises(BatchError, match="seed=-1"):
        ShardedIterator(data, plan, batch_size=8, seed=-1)
    it = ShardedIterator(data, plan, batch_size=8)
    with pytest.raises(BatchError, match="exactly the keys 'step' and 'seed'"):
        it.set_state({"step": 3})
    with pytest.raises(BatchError, match="step=-2"):
        it.set_state({"step": -2, "seed": 0})
