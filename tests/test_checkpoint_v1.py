"""Checkpoints of format version 1, which do not record the order of their layer
stacks: eqxpar 0.1.0 saved a stack as the model held it (an interleaved or uneven
pipeline's order, the model reordered by hand), later version-1 files in natural
order. `restore` refuses to guess for a target that stores a stack permuted, and
`stored_order` says which order the file holds.

tests/data/checkpoint_v1 holds files the code before 1cf3aa3 wrote
(`make_fixture.py` there): a `Tiny` model's train state after one AdamW step under
an interleaved plan, with equal stages (`interleaved`: the stack permuted) and
uneven ones (`uneven`: permuted and padded), and in `expected.npz` every array as
saved and in natural order (put back by that code's own `from_pipeline_order`).
"""

import json
import pathlib
import re
import shutil

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.checkpoint import CheckpointError, CheckpointManager
from eqxpar.nn import in_natural_order

from ._helpers import Tiny, assert_trees_close, pipeline_plan, regression_batch, tiny_loss

pytest.importorskip("orbax.checkpoint")

FIXTURE = pathlib.Path(__file__).parent / "data" / "checkpoint_v1"
# (layers, stage_layers) of each saved case, as make_fixture.py's CASES.
CASES = {"interleaved": (4, None), "uneven": (5, (1, 2, 1, 1))}


def saved_plan(case):
    """The interleaved plan the case was saved under (make_fixture.py's)."""
    return pipeline_plan("interleaved", pipe=2, microbatches=4, chunks=2, stage_layers=CASES[case][1])


def data_plan():
    return eqxpar.Plan(eqxpar.make_mesh(data=8))


def outline(case, plan):
    model = Tiny(CASES[case][0], key=jax.random.key(5))
    return eqx.filter_eval_shape(eqxpar.train.init, model, optax.adamw(1e-2), plan, key=jax.random.key(1))


def fixture(case, tmp_path):
    """A manager of a copy of the case's checkpoint (a restore may not write into
    the repository)."""
    shutil.copytree(FIXTURE / case, tmp_path / case)
    return CheckpointManager(tmp_path / case)


def arrays(tree):
    """Every array leaf by its path, as numpy (PRNG keys as their key data)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
    out = {}
    for path, leaf in flat:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(leaf))
    return out


def assert_saved(tree, case, kind):
    """`tree`'s arrays are bit for bit those expected.npz holds for `case`, `kind`
    "stored" (as the file holds them) or "natural"."""
    expected = np.load(FIXTURE / "expected.npz")
    prefix = f"{case}/{kind}"
    want = {k[len(prefix) :]: expected[k] for k in expected.files if k.startswith(prefix + ".")}
    got = arrays(tree)
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        assert got[path].dtype == value.dtype and got[path].shape == value.shape, path
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def metadata_file(directory, step):
    return next(p for p in (directory / str(step) / "eqxpar").rglob("*") if p.is_file())


@pytest.mark.parametrize("case", CASES)
def test_a_version_1_file_is_refused_where_its_order_matters(case, tmp_path):
    plan = saved_plan(case)
    with fixture(case, tmp_path) as manager, pytest.raises(CheckpointError) as error:
        manager.restore(like=outline(case, plan), plan=plan)
    message = str(error.value)
    assert f"{str(tmp_path / case / '1')!r} is an eqxpar checkpoint of version 1" in message
    assert "stores .model.blocks (and 2 more stacks) in pipeline order (2 stages x 2 chunks" in message
    assert "stored_order='plan' if it was saved under this plan" in message
    assert "save it again with this eqxpar (version 2" in message


@pytest.mark.parametrize("case", CASES)
def test_stored_order_plan_restores_what_the_old_code_saved(case, tmp_path):
    plan = saved_plan(case)
    with fixture(case, tmp_path) as manager:
        restored, data_state = manager.restore(like=outline(case, plan), plan=plan, stored_order="plan")
    assert data_state == {"step": 1}
    # In the plan's order, row for row the file's; in natural order, what the old
    # code's from_pipeline_order gave.
    order = plan.stack_order(CASES[case][0])
    assert order is not None and restored.model.blocks.order == order
    assert_saved(restored, case, "stored")
    assert_saved(in_natural_order(restored), case, "natural")
    # The pipeline's loss is one device's on the natural-order model (a layer out
    # of place would change it).
    batch = regression_batch(8)
    loss, _ = eqxpar.train.make_value_and_grad(tiny_loss(), plan)(restored.model, batch)
    one_device = eqx.filter_jit(tiny_loss())(in_natural_order(restored.model), batch)
    assert_trees_close(float(loss), float(one_device))


@pytest.mark.parametrize("case", CASES)
def test_stored_order_names_the_plan_a_file_was_saved_under(case, tmp_path):
    # Restored under data parallelism (natural order), naming the plan it was saved under.
    target = data_plan()
    with fixture(case, tmp_path) as manager:
        restored, _ = manager.restore(like=outline(case, target), plan=target, stored_order=saved_plan(case))
    assert restored.model.blocks.order is None
    assert_saved(restored, case, "natural")


def test_version_2_round_trip_and_a_natural_order_version_1_file(tmp_path):
    plan = saved_plan("interleaved")
    state = eqxpar.train.init(Tiny(4, key=jax.random.key(0)), optax.adamw(1e-2), plan, key=jax.random.key(1))
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
        manager.wait()
        meta = metadata_file(tmp_path, 1)
        assert json.loads(meta.read_text())["version"] == 2
        restored, _ = manager.restore(like=state, plan=plan)
        assert restored.model.blocks.order == state.model.blocks.order
        assert arrays(restored).keys() == arrays(state).keys()
        for path, value in arrays(state).items():
            np.testing.assert_array_equal(arrays(restored)[path], value, err_msg=path)
        # A version-2 file records its order: stored_order is refused, not ignored.
        with pytest.raises(
            CheckpointError, match=r"version 2, .*stored_order='plan' has nothing.*Drop stored_order"
        ):
            manager.restore(like=state, plan=plan, stored_order="plan")

        # The same file as version 1 (as eqxpar wrote it between the layer-order
        # change and version 2): natural order, which it must be told.
        meta.write_text(meta.read_text().replace('"version": 2', '"version": 1'))
        with pytest.raises(CheckpointError, match="of version 1, which does not record"):
            manager.restore(like=state, plan=plan)
        restored, _ = manager.restore(like=state, plan=plan, stored_order="natural")
        for path, value in arrays(state).items():
            np.testing.assert_array_equal(arrays(restored)[path], value, err_msg=path)
        # Under a plan that stores every stack in natural order it restores as before.
        target = data_plan()
        restored, _ = manager.restore(like=outline("interleaved", target), plan=target)
        assert restored.model.blocks.order is None
        for path, value in arrays(in_natural_order(state)).items():
            np.testing.assert_array_equal(arrays(restored)[path], value, err_msg=path)

        # A version this eqxpar does not know is refused, as before.
        meta.write_text(meta.read_text().replace('"version": 1', '"version": 3'))
        with pytest.raises(CheckpointError, match=r"version 3; this eqxpar reads versions 1, 2\."):
            manager.restore(like=state, plan=plan, stored_order="plan")


@pytest.mark.parametrize("bad", ["pipeline", "Natural", ""])
def test_a_bad_stored_order_is_refused_before_reading(bad, tmp_path):
    # Refused before anything is read: the empty directory has no checkpoint.
    plan = saved_plan("interleaved")
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(
            CheckpointError, match=re.escape(f"restore(stored_order={bad!r}): expected 'natural'")
        ):
            manager.restore(like=outline("interleaved", plan), plan=plan, stored_order=bad)
