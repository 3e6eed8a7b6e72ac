"""eqxpar.checkpoint: sharded async save, restore onto another mesh, damage and crashes."""

import contextlib
import json
import os
import pathlib
import stat
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.checkpoint
from eqxpar.checkpoint import CheckpointError, CheckpointManager

from ._helpers import mse_loss

HERE = pathlib.Path(__file__).parent


def regression_batches(n):
    # numpy, not jax.random: eager random ops would each compile, and time matters here.
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(32, 16)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32))
        for _ in range(n)
    ]


@pytest.fixture(autouse=True)
def _close_managers(monkeypatch):
    """Close every manager a test opened, when the test ends. Left to the garbage
    collector, orbax's threads may post to an asyncio event loop that is closed by
    then, and pytest reports that ("Event loop is closed") in whichever test runs next."""
    opened = []
    init = CheckpointManager.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(CheckpointManager, "__init__", tracking_init)
    yield
    for manager in opened:
        # A save the test made fail on purpose has raised already.
        with contextlib.suppress(CheckpointError):
            manager.close()


def _fsdp_plan(**sizes):
    return eqxpar.Plan(eqxpar.make_mesh(**sizes), rules=eqxpar.rules.FSDP(min_size=256))


def _state(plan, *, width=64, seed=0):
    model = eqx.nn.MLP(16, 4, width, 2, key=jax.random.key(seed))
    optimizer = optax.adamw(1e-2)
    return eqxpar.train.init(model, optimizer, plan, key=jax.random.key(seed + 1)), optimizer


def _host(state):
    """Every array leaf as numpy (key arrays as their key data), in flattening order."""
    out = []
    for leaf in jax.tree.leaves(eqx.filter(state, eqx.is_array)):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.array(leaf))
    return out


def _assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def test_async_save_survives_donated_steps_and_keeps_last_k(tmp_path):
    plan = _fsdp_plan(fsdp=8)
    state, optimizer = _state(plan)
    step = eqxpar.train.make_step(mse_loss, optimizer, plan)
    batches = regression_batches(5)
    manager = CheckpointManager(tmp_path / "all", max_to_keep=None)
    assert manager.latest_step() is None
    snapshots = {}
    for i, batch in enumerate(batches[:4], start=1):
        state, _ = step(state, batch)
        snapshots[i] = _host(state)
        # The next step donates and overwrites these buffers while the save may
        # still be writing in the background; the checkpoint must hold step i's values.
        manager.save(i, state, data_state={"step": i, "seed": 7})
    manager.wait()
    assert manager.all_steps() == [1, 2, 3, 4]
    for i in (2, 4):
        restored, data_state = manager.restore(i, like=state, plan=plan)
        assert data_state == {"step": i, "seed": 7}
        assert int(restored.step) == i
        _assert_bitwise_equal(_host(restored), snapshots[i])
    restored, _ = manager.restore(2, like=state, plan=plan)
    want = jax.tree.leaves(eqxpar.named_shardings(eqx.filter(restored, eqx.is_array), plan))
    assert [leaf.sharding for leaf in jax.tree.leaves(eqx.filter(restored, eqx.is_array))] == want
    # The non-array parts come from `like`, not from the file.
    assert restored.model.activation is state.model.activation
    # A restored state trains on bit for bit as the original did.
    again, _ = step(restored, batches[2])
    _assert_bitwise_equal(_host(again), snapshots[3])
    manager.close()

    with CheckpointManager(tmp_path / "last2", max_to_keep=2) as keep:
        for i in range(4):
            keep.save(i, again)
    assert CheckpointManager(tmp_path / "last2").all_steps() == [2, 3]
    _, data_state = CheckpointManager(tmp_path / "last2").restore(like=again, plan=plan)
    assert data_state is None


def test_keep_every_keeps_multiples_beside_the_latest(tmp_path):
    state = {"w": jnp.arange(8.0)}
    with CheckpointManager(tmp_path, max_to_keep=2, keep_every=4) as manager:
        for i in range(1, 11):
            manager.save(i, state)
    assert CheckpointManager(tmp_path).all_steps() == [4, 8, 9, 10]
    with pytest.raises(CheckpointError, match=r"keep_every=0.*>= 1"):
        CheckpointManager(tmp_path, keep_every=0)
    with pytest.raises(CheckpointError, match=r"keep_every=5, max_to_keep=None.*kept already"):
        CheckpointManager(tmp_path, max_to_keep=None, keep_every=5)


def _inject_save_failures(monkeypatch, *, in_background=(), in_save=()):
    """Make orbax fail saving some steps: `in_background`, where the files are
    finalised in the background thread (disk full); `in_save`, in `save` itself
    (the step directory cannot be made)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    commit = async_checkpointer._on_commit_callback
    save = ocp.CheckpointManager.save

    def failing_commit(tmpdir, *args, **kwargs):
        if int(tmpdir.get_final().name) in in_background:
            raise OSError(28, "No space left on device")
        return commit(tmpdir, *args, **kwargs)

    def failing_save(self, step, *args, **kwargs):
        if step in in_save:
            raise PermissionError(13, "Permission denied")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", failing_commit)
    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)


def test_a_failed_save_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    _inject_save_failures(monkeypatch, in_background=(3, 6), in_save=(5,))
    manager = CheckpointManager(tmp_path, max_to_keep=None, on_save_error="warn")
    for i in range(1, 7):
        manager.save(i, {"w": jnp.full(8, float(i))}, data_state={"step": i})
    manager.wait()
    warnings = [r.getMessage() for r in caplog.records if r.name == "eqxpar.checkpoint"]
    assert [w.split(" was not saved")[0] for w in warnings] == [
        "[rank 0/1] checkpoint step 3",
        "[rank 0/1] checkpoint step 5",
        "[rank 0/1] checkpoint step 6",
    ]
    assert "OSError: [Errno 28] No space left on device" in warnings[0]
    assert "PermissionError: [Errno 13] Permission denied" in warnings[1]
    assert "latest complete checkpoint (now step 4)" in warnings[2]
    # The failed saves are not checkpoints: the latest complete one is restored.
    assert manager.all_steps() == [1, 2, 4]
    restored, data_state = manager.restore(like={"w": jnp.zeros(8)})
    assert data_state == {"step": 4}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(8, 4.0))
    manager.save(7, {"w": jnp.zeros(8)})  # and saving goes on
    manager.close()
    assert CheckpointManager(tmp_path).all_steps() == [1, 2, 4, 7]


def test_a_failed_save_is_logged_by_default_once_a_save_has_completed(tmp_path, monkeypatch, caplog):
    # A long run survives a passing fault by default; a failure before any save has
    # completed is a set-up error and raises, as does any failure with "raise".
    _inject_save_failures(monkeypatch, in_background=(1, 3))
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"w": jnp.ones(8)})  # returns: the failure comes in the background
    with pytest.raises(CheckpointError, match=r"writing checkpoint step 1 to .* failed: OSError"):
        manager.wait()
    manager.save(2, {"w": jnp.ones(8)})
    manager.save(3, {"w": jnp.ones(8)})
    manager.wait()  # logged, not raised
    assert [
        r.getMessage().split(" was not saved")[0] for r in caplog.records if r.name == "eqxpar.checkpoint"
    ] == ["[rank 0/1] checkpoint step 3"]
    assert manager.latest_step() == 2
    manager.close()
    strict = CheckpointManager(tmp_path / "strict", on_save_error="raise")
    strict.save(2, {"w": jnp.ones(8)})
    strict.save(3, {"w": jnp.ones(8)})
    with pytest.raises(CheckpointError, match=r"writing checkpoint step 3 to .* failed: OSError"):
        strict.wait()
    with pytest.raises(CheckpointError, match=r"on_save_error='ignore'.*'raise', 'warn'"):
        CheckpointManager(tmp_path, on_save_error="ignore")


def test_skipped_steps_survive_save_and_restore(tmp_path):
    plan = _fsdp_plan(fsdp=8)
    state, optimizer = _state(plan)
    step = eqxpar.train.make_step(mse_loss, optimizer, plan, skip_nonfinite=True)
    good = regression_batches(1)[0]
    bad = (good[0].copy(), good[1])
    bad[0][5, 2] = np.nan
    state, _ = step(state, good)
    state, metrics = step(state, bad)
    assert bool(metrics["skipped"]) and int(state.skipped_steps) == 1
    saved = _host(state)
    with CheckpointManager(tmp_path) as manager:
        manager.save(int(state.step), state)
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(9))
    abstract = eqx.filter_eval_shape(eqxpar.train.init, model, optimizer, plan, key=jax.random.key(3))
    restored, _ = CheckpointManager(tmp_path).restore(like=abstract, plan=plan)
    assert int(restored.step) == 2 and int(restored.skipped_steps) == 1
    _assert_bitwise_equal(_host(restored), saved)
    # The count goes on from the restored value.
    restored, metrics = step(restored, bad)
    assert int(metrics["skipped_steps"]) == int(restored.skipped_steps) == 2


class _StateBeforeSkippedSteps(eqx.Module):
    """A `TrainState` as saved before it counted skipped steps: the same paths."""

    model: object
    opt_state: object
    step: jax.Array
    key: jax.Array


def test_restores_a_train_state_saved_before_skipped_steps(tmp_path):
    plan = _fsdp_plan(fsdp=8)
    state, _ = _state(plan)
    old = _StateBeforeSkippedSteps(state.model, state.opt_state, state.step, state.key)
    with CheckpointManager(tmp_path) as manager:
        manager.save(0, old)
    restored, _ = CheckpointManager(tmp_path).restore(like=state, plan=plan)
    assert int(restored.skipped_steps) == 0 and restored.skipped_steps.sharding.spec == P()
    _assert_bitwise_equal(_host(restored), [*_host(old), np.zeros((), np.int32)])
    # Only a TrainState's missing count is filled in; any other missing leaf still fails.
    n = len(_host(old))
    with pytest.raises(CheckpointError, match=rf"holds {n} arrays but `like` has {n + 1}\."):
        CheckpointManager(tmp_path).restore(like=(old, state.step), plan=plan)


def test_restore_onto_another_mesh(tmp_path):
    source = _fsdp_plan(fsdp=8)
    state, optimizer = _state(source)
    step = eqxpar.train.make_step(mse_loss, optimizer, source)
    state, _ = step(state, regression_batches(1)[0])
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state)

    rules = [
        eqxpar.rules.ByPath([(r"layers\[1\]\.weight$", P("tensor", "fsdp"))], strict=False),
        eqxpar.rules.FSDP(min_size=256),
    ]
    target = eqxpar.Plan(eqxpar.make_mesh(fsdp=4, tensor=2), rules=rules)
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(99))
    abstract = eqx.filter_eval_shape(eqxpar.train.init, model, optimizer, target, key=jax.random.key(5))
    restored, _ = CheckpointManager(tmp_path).restore(like=abstract, plan=target)

    _assert_bitwise_equal(_host(restored), _host(state))
    weight = restored.model.layers[1].weight
    assert weight.sharding.spec == P("tensor", "fsdp")
    assert weight.sharding.mesh.shape["tensor"] == 2
    mu = restored.opt_state[0].mu.layers[1].weight
    assert mu.sharding.spec == P("tensor", "fsdp")


def test_truncated_array_file_raises_an_eqxpar_error_and_the_other_step_loads(tmp_path):
    # In a subprocess: when one shard fails to read, orbax closes its event loop
    # while tensorstore still finishes the other shards' reads on its own threads,
    # which then report "Event loop is closed" for a while, at whatever the process
    # is doing (pytest would fail a later test).
    result = subprocess.run(
        [sys.executable, str(HERE / "_multihost_script.py"), "restore-truncated", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith("CheckpointError"))
    # An eqxpar error naming the checkpoint and the fix, and the steps that do load.
    assert f"{tmp_path / 'run' / '2'}" in error and "restore an earlier step" in error and "[1]" in error
    assert "step 1 restored equal: True, data_state {'step': 1}" in result.stdout


def test_damaged_or_foreign_checkpoints_raise_eqxpar_errors(tmp_path):
    plan = _fsdp_plan(fsdp=8)
    state, _ = _state(plan)
    with CheckpointManager(tmp_path / "run", max_to_keep=None) as manager:
        manager.save(1, state, data_state={"step": 1, "seed": 0})
    manager = CheckpointManager(tmp_path / "run")

    # Garbage metadata.
    meta = next(p for p in (tmp_path / "run" / "1" / "eqxpar").rglob("*") if p.is_file())
    meta.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"run/1"):
        manager.restore(1, like=state, plan=plan)

    # Another model's checkpoint.
    other = eqx.tree_at(lambda s: s.model.layers[0].weight, state, jnp.zeros((64, 8)))
    with CheckpointManager(tmp_path / "other") as m:
        m.save(0, other)
    with pytest.raises(CheckpointError, match=r"does not match `like`.*layers\[0\]\.weight"):
        with CheckpointManager(tmp_path / "other") as m:
            m.restore(like=state, plan=plan)

    # A directory some other tool wrote is no checkpoint.
    foreign = tmp_path / "foreign" / "3"
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_bytes(b"\x00" * 64)
    with CheckpointManager(tmp_path / "foreign") as m:
        assert m.latest_step() is None
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            m.restore(like=state, plan=plan)
    # Closed, not left to the garbage collector: orbax's threads would post to an
    # event loop closed by then, which pytest reports in a later test.
    manager.close()


def test_incomplete_step_directories_are_not_checkpoints(tmp_path):
    like = {"w": jnp.zeros(8)}
    with CheckpointManager(tmp_path, max_to_keep=None) as manager:
        manager.save(1, {"w": jnp.arange(8.0)}, data_state={"step": 1, "seed": 0})
    # An empty step directory, and one copied halfway (arrays but no record).
    (tmp_path / "3").mkdir()
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "state").mkdir()
    (tmp_path / "2" / "state" / "_METADATA").write_text("{}")
    (tmp_path / "2" / "eqxpar").mkdir()

    manager = CheckpointManager(tmp_path, max_to_keep=2)
    assert manager.all_steps() == [1]
    assert manager.latest_step() == 1
    restored, data_state = manager.restore(like=like)  # the newest complete one
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(8.0))
    assert data_state == {"step": 1, "seed": 0}
    with pytest.raises(CheckpointError, match=r"step 3 is incomplete in .*complete steps: \[1\]"):
        manager.restore(3, like=like)
    with pytest.raises(CheckpointError, match=r"step 2 already exists .*incomplete.*delete '.*2'"):
        manager.save(2, like)
    # They do not count towards max_to_keep either: step 1 stays, and they are
    # left alone.
    manager.save(4, like)
    manager.close()
    assert CheckpointManager(tmp_path).all_steps() == [1, 4]
    assert (tmp_path / "2").is_dir() and (tmp_path / "3").is_dir()


def test_saving_into_a_read_only_directory_raises_and_exits(tmp_path):
    # In a subprocess: the process must not hang at exit after the error (orbax's
    # writer threads used to wait 20 minutes for a directory never made).
    directory = tmp_path / "ckpt"
    try:
        result = subprocess.run(
            [sys.executable, str(HERE / "_multihost_script.py"), "save-read-only", str(directory)],
            capture_output=True,
            text=True,
            timeout=90,
        )
        exited = time.time()
    finally:
        if directory.exists():
            directory.chmod(stat.S_IRWXU)
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith("CheckpointError"))
    assert str(directory) in error and "PermissionError" in error
    assert f"Fix: make {str(directory)!r} writable" in error
    raised_at = float(result.stdout.split("raised at ")[1].split()[0])
    assert exited - raised_at < 10
    assert not os.listdir(directory)


def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    directory = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, str(HERE / "_multihost_script.py"), "crash-mid-save", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -9, result.stderr[-3000:]
    assert "crashing mid-save" in result.stdout
    leftovers = [p.name for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert leftovers, sorted(p.name for p in directory.iterdir())  # it really died inside the save

    manager = CheckpointManager(directory)
    assert manager.all_steps() == [1]
    like = {"key": jax.random.key(0), "w": jnp.zeros(8)}
    restored, data_state = manager.restore(like=like)
    assert data_state == {"step": 1, "seed": 0}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(8.0))
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(restored["key"])), np.asarray(jax.random.key_data(jax.random.key(3)))
    )
    # The next save goes through, and the crashed one's leftovers are gone.
    manager.save(2, like)
    manager.close()
    assert CheckpointManager(directory).all_steps() == [1, 2]
    assert not [p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def test_bad_arguments(tmp_path, monkeypatch):
    plan = _fsdp_plan(fsdp=8)
    state, _ = _state(plan)
    manager = CheckpointManager(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        manager.restore(like=state, plan=plan)
    with pytest.raises(CheckpointError, match=r"step=-1"):
        manager.save(-1, state)
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        manager.save(0, state, data_state={"step": object()})
    with pytest.raises(CheckpointError, match="no array leaves"):
        manager.save(0, {"lr": 0.1})
    manager.save(0, state)
    manager.wait()
    with pytest.raises(CheckpointError, match="already exists"):
        manager.save(0, state)
    with pytest.raises(CheckpointError, match=r"step 7 is not in .*\[0\]"):
        manager.restore(7, like=state, plan=plan)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), eqx.filter(state, eqx.is_array))
    with pytest.raises(CheckpointError, match="has no sharding"):
        manager.restore(like=abstract)
    with pytest.raises(CheckpointError, match="max_to_keep=0"):
        CheckpointManager(tmp_path / "d", max_to_keep=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointManager(tmp_path / "file")
    assert json.loads(json.dumps(manager.all_steps())) == [0]
    manager.close()

    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(CheckpointError, match=r"pip install eqxpar\[checkpoint\]"):
        CheckpointManager(tmp_path / "e")
