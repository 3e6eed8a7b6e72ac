"""eqxpar.data.TokenFile and the grain adapter: token ids on disk, read as sequences,
each process its own rows, in an order that does not depend on the process count.

One test runs a small script as 1 process x 8 devices and as 2 processes x 4
devices through eqxpar.launch and compares their batches and what each read.
"""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import eqxpar
import eqxpar.launch
from eqxpar import BatchError
from eqxpar.data import GrainSampler, ShardedIterator, TokenFile, grain_sampler

from ._compile_flags import suite_xla_flags


def _write(tmp_path, ids, dtype=np.uint16, name="train.bin"):
    path = tmp_path / name
    np.asarray(ids).astype(dtype).tofile(path)
    return path


def _plan(**axes):
    return eqxpar.Plan(eqxpar.make_mesh(**(axes or {"data": 8})))


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32])
def test_sequences_overlap_by_one_token_and_read_as_int32(tmp_path, dtype):
    ids = (np.arange(1003) * 7) % 50_000
    tokens = TokenFile(_write(tmp_path, ids, dtype), seq_len=10, dtype=dtype)
    assert (len(tokens), tokens.num_tokens, tokens.dtype, tokens.seq_len) == (100, 1003, np.dtype(dtype), 10)
    for i in (0, 1, 57, 99, -1):
        row = tokens[i]
        start = (i % 100) * 10
        assert row.dtype == np.int32 and row.shape == (11,)
        np.testing.assert_array_equal(row, ids[start : start + 11])
    # Consecutive sequences share their boundary token: every token is a target once.
    assert tokens[3][-1] == tokens[4][0]
    rows = tokens.read(np.array([9, 0, 9, 42]))
    assert rows.dtype == np.int32 and rows.shape == (4, 11)
    np.testing.assert_array_equal(rows, np.stack([tokens[i] for i in (9, 0, 9, 42)]))
    with pytest.raises(IndexError, match="sequence 100 is out of range; the file has 100"):
        tokens[100]
    with pytest.raises(IndexError, match="out of range"):
        tokens.read([0, -101])


def test_npy_file_and_pickling_reopen_the_file(tmp_path):
    ids = np.arange(500, dtype=np.uint32)
    path = tmp_path / "ids.npy"
    np.save(path, ids)
    tokens = TokenFile(path, seq_len=16)
    assert tokens.dtype == np.uint32 and len(tokens) == 31
    np.testing.assert_array_equal(tokens[2], ids[32:49])
    # A grain worker gets the path, not the data, and maps the file itself.
    blob = pickle.dumps(tokens)
    assert len(blob) < 500
    again = pickle.loads(blob)
    np.testing.assert_array_equal(again.read([5, 7]), tokens.read([5, 7]))
    assert repr(again) == repr(tokens)
    assert TokenFile(path, seq_len=16, dtype=np.uint32).num_tokens == 500


def test_bad_files_and_arguments_name_the_fix(tmp_path):
    raw = _write(tmp_path, np.arange(100))
    with pytest.raises(BatchError, match=r"no such file.*nanoGPT"):
        TokenFile(tmp_path / "missing.bin", seq_len=8, dtype=np.uint16)
    with pytest.raises(BatchError, match=r"does not record its dtype.*dtype=np.uint16"):
        TokenFile(raw, seq_len=8)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 202)
    with pytest.raises(BatchError, match=r"202 bytes, not a multiple of\s+4 \(uint32's size\).*np.uint16"):
        TokenFile(odd, seq_len=8, dtype=np.uint32)
    with pytest.raises(
        BatchError, match=r"holds 100 tokens, fewer than one sequence of seq_len \+ 1 = 101.*seq_len <= 99"
    ):
        TokenFile(raw, seq_len=100, dtype=np.uint16)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(BatchError, match="holds 0 tokens"):
        TokenFile(empty, seq_len=1, dtype=np.uint16)
    with pytest.raises(BatchError, match=r"seq_len=0.*integer >= 1"):
        TokenFile(raw, seq_len=0, dtype=np.uint16)
    with pytest.raises(BatchError, match=r"dtype=<class 'numpy.float32'>.*integers"):
        TokenFile(raw, seq_len=8, dtype=np.float32)
    np.save(tmp_path / "two_d.npy", np.zeros((4, 50), np.uint16))
    with pytest.raises(BatchError, match=r"shape \(4, 50\).*one flat integer array"):
        TokenFile(tmp_path / "two_d.npy", seq_len=8)
    np.save(tmp_path / "floats.npy", np.zeros(100, np.float32))
    with pytest.raises(BatchError, match="float32 array"):
        TokenFile(tmp_path / "floats.npy", seq_len=8)
    np.save(tmp_path / "ids.npy", np.zeros(100, np.uint16))
    with pytest.raises(BatchError, match=r"says its ids are uint16.*Leave dtype out"):
        TokenFile(tmp_path / "ids.npy", seq_len=8, dtype=np.uint32)
    cut = tmp_path / "cut.npy"
    cut.write_bytes((tmp_path / "ids.npy").read_bytes()[:-10])
    with pytest.raises(BatchError, match=r"promises 100 ids of uint16.*cut short"):
        TokenFile(cut, seq_len=8)
    with pytest.raises(BatchError, match=r"not a \.npy file eqxpar can map"):
        TokenFile(raw.rename(tmp_path / "raw.npy"), seq_len=8)
    # Ids int32 cannot hold are refused when read (the file is never scanned whole).
    big = TokenFile(
        _write(tmp_path, [1, 2, 2**31 + 5, 3, 4], np.uint32, "big.bin"), seq_len=2, dtype=np.uint32
    )
    with pytest.raises(BatchError, match=r"outside \[0, 2147483647\].*Check the dtype"):
        big[1]
    negative = TokenFile(_write(tmp_path, [1, -2, 3], np.int16, "neg.bin"), seq_len=2, dtype=np.int16)
    with pytest.raises(BatchError, match="read ids from -2 to 3"):
        negative.read([0])


def _resident_kb(path):
    """Resident kB of this process: anonymous, and of its mappings of the file at `path`."""
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    mapped, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                inside = head[-1] == os.path.realpath(path)
            elif inside and head[0] == "Rss:":
                mapped += int(head[1])
    return anon, mapped


# Slow (40 s on 2 cores: a file large enough to see residency): `make test-slow`.
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
def test_reading_keeps_no_part_of_the_file_resident(tmp_path):
    # 64 MiB of ids (in the page cache: just written), read in a random order:
    # the pages are unmapped once copied, so none of the file stays resident in
    # the process and its own memory does not grow with what it read.
    path = tmp_path / "big.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(8):
            rng.integers(0, 60_000, size=1 << 22, dtype=np.uint16).tofile(f)
    tokens = TokenFile(path, seq_len=1024, dtype=np.uint16)
    tokens.read([0])
    anon_before, _ = _resident_kb(path)
    order = rng.permutation(len(tokens))
    for start in range(0, 16_000, 500):  # 16,000 of 32,767 sequences, about half the file
        rows = tokens.read(order[start : start + 500])
        tokens[int(order[start])]
        anon, mapped = _resident_kb(path)
        assert mapped == 0, f"{mapped} kB of the file resident after reading {start + 500} rows"
    assert rows.shape == (500, 1025)
    assert anon - anon_before < 8192


def _tokens(tmp_path, n=2000, seq_len=9):
    ids = np.random.default_rng(0).integers(0, 60_000, size=n)
    return TokenFile(_write(tmp_path, ids), seq_len=seq_len, dtype=np.uint16)


def test_iterator_reads_its_rows_in_the_in_memory_order_and_resumes(tmp_path):
    tokens = _tokens(tmp_path)  # 222 sequences
    plan = _plan()
    it = ShardedIterator(tokens, plan, batch_size=16, seed=7)
    # The same order as the in-memory iterator over the file's sequences.
    in_memory = ShardedIterator(tokens.read(np.arange(len(tokens))), plan, batch_size=16, seed=7)
    assert it.steps_per_epoch == 13 and it.rows == slice(0, 16)
    for step in range(30):  # across two epoch boundaries
        batch = next(it)
        assert batch.dtype == np.int32 and batch.shape == (16, 10)
        np.testing.assert_array_equal(batch, next(in_memory))
        np.testing.assert_array_equal(batch, tokens.read(it.global_indices(step)))
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"step": 30, "seed": 7}
    expected = [next(it) for _ in range(4)]
    resumed = ShardedIterator(tokens, plan, batch_size=16, seed=0)
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)
    # Each epoch's order is computed once and kept (not once per step).
    assert it._order(2) is it._order(2)


def test_data_state_round_trips_through_a_checkpoint(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp

    import eqxpar.checkpoint

    tokens = _tokens(tmp_path)
    plan = _plan()
    it = ShardedIterator(tokens, plan, batch_size=8, seed=3)
    for _ in range(5):
        next(it)
    manager = eqxpar.checkpoint.CheckpointManager(tmp_path / "ckpt")
    manager.save(5, {"w": jnp.zeros(4)}, data_state=it.get_state())
    manager.wait()
    _, data_state = manager.restore(like={"w": jnp.zeros(4)}, plan=plan)
    manager.close()
    resumed = ShardedIterator(tokens, plan, batch_size=8, seed=3)
    resumed.set_state(data_state)
    np.testing.assert_array_equal(next(resumed), next(it))


def _shard_rows(sampler, steps, workers=0):
    """The record keys a grain DataLoader with `workers` worker processes takes from
    this shard's sampler, one row per batch it yields: worker w takes the shard's
    records w, w + W, w + 2W, ... and batches them, and the loader yields the
    workers' batches in turn."""
    count = sampler.shard_options.shard_count
    index = sampler.shard_options.shard_index
    local = sampler.local_batch_size
    w_count = max(workers, 1)
    out = []
    for step in range(steps):
        batch, worker = divmod(step, w_count)
        records = [worker + w_count * j for j in range(batch * local, (batch + 1) * local)]
        out.append([sampler[k * count + index].record_key for k in records])
    return np.asarray(out)


@pytest.mark.parametrize("shuffle", [True, False])
def test_grain_sampler_order_does_not_depend_on_the_shard_count(shuffle):
    pytest.importorskip("grain")
    reference = ShardedIterator(np.arange(100), _plan(), batch_size=16, seed=11, shuffle=shuffle)
    steps = 14  # past the end of the first epoch (6 steps of 16 out of 100)
    want = np.stack([reference.global_indices(s) for s in range(steps)])
    for count, workers in ((1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (1, 3), (2, 2), (4, 5)):
        shards = [
            _shard_rows(
                GrainSampler(
                    100,
                    batch_size=16,
                    shard_index=i,
                    shard_count=count,
                    seed=11,
                    shuffle=shuffle,
                    worker_count=workers,
                ),
                steps,
                workers,
            )
            for i in range(count)
        ]
        np.testing.assert_array_equal(
            np.concatenate(shards, axis=1), want, err_msg=f"{count} shards, {workers} workers"
        )
    # Started at a step, it continues where a run from step 0 was.
    later = GrainSampler(100, batch_size=16, shard_index=1, shard_count=2, seed=11, shuffle=shuffle, step=9)
    np.testing.assert_array_equal(_shard_rows(later, 5), want[9:14, 8:16])
    # Each record's rng depends on its global position, not on the shard layout.
    one = GrainSampler(100, batch_size=16, seed=11)
    two = GrainSampler(100, batch_size=16, shard_index=1, shard_count=2, seed=11)
    # Step 1, row 8: record 24 of one shard; the second shard's 8th record, index 8 * 2 + 1.
    assert one[24].record_key == two[17].record_key
    assert one[24].rng.integers(1 << 30) == two[17].rng.integers(1 << 30)
    assert one[3].rng.integers(1 << 30) != one[4].rng.integers(1 << 30)


def test_grain_loader_yields_the_iterator_batches(tmp_path):
    pytest.importorskip("grain")
    tokens = _tokens(tmp_path)
    plan = _plan(data=4, tensor=2)
    reference = ShardedIterator(tokens, plan, batch_size=16, seed=2)
    loader = iter(eqxpar.data.grain_loader(tokens, plan, batch_size=16, seed=2))
    for _ in range(15):
        np.testing.assert_array_equal(next(loader), next(reference))
    resumed = iter(eqxpar.data.grain_loader(tokens, plan, batch_size=16, seed=2, step=reference.step))
    for _ in range(3):
        np.testing.assert_array_equal(next(resumed), next(reference))
    epochs = list(eqxpar.data.grain_loader(tokens, plan, batch_size=16, seed=2, num_epochs=1))
    assert len(epochs) == reference.steps_per_epoch
    sampler = grain_sampler(len(tokens), plan, batch_size=16, seed=2, step=3, num_epochs=2)
    assert len(sampler) == (2 * 13 - 3) * 16
    with pytest.raises(IndexError, match="out of range"):
        sampler[len(sampler)]


_WORKERS = """
import gc, sys
import numpy as np
import eqxpar, eqxpar.data

if __name__ == "__main__":
    tokens = eqxpar.data.TokenFile(sys.argv[1], seq_len=9, dtype=np.uint16)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2))
    reference = eqxpar.data.ShardedIterator(tokens, plan, batch_size=16, seed=2)
    loader = iter(eqxpar.data.grain_loader(tokens, plan, batch_size=16, seed=2, worker_count=2))
    same = all((next(loader) == next(reference)).all() for _ in range(7))
    del loader  # stops grain's workers now, not during the interpreter's shutdown
    gc.collect()
    print("same" if same else "different")
"""


def test_grain_loader_with_worker_processes_yields_the_iterator_batches(tmp_path):
    # Worker processes each batch their own records, which the sampler accounts
    # for; run apart, as grain's workers and shared memory outlive a test's checks.
    pytest.importorskip("grain")
    _tokens(tmp_path)
    script = tmp_path / "workers.py"
    script.write_text(_WORKERS)
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags("--xla_force_host_platform_device_count=8")}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "train.bin")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "same", result.stdout


def test_grain_errors_and_missing_grain(monkeypatch):
    with pytest.raises(BatchError, match=r"shard_index=2 is not below shard_count=2"):
        GrainSampler(100, batch_size=8, shard_index=2, shard_count=2)
    with pytest.raises(BatchError, match=r"batch_size=10 does not split over shard_count=4.*multiple of 4"):
        GrainSampler(100, batch_size=10, shard_count=4)
    with pytest.raises(BatchError, match=r"larger than the data source \(5 records\)"):
        GrainSampler(5, batch_size=8)
    with pytest.raises(BatchError, match="num_epochs=0"):
        GrainSampler(100, batch_size=8, num_epochs=0)
    with pytest.raises(BatchError, match="not divisible by the 8"):
        grain_sampler(100, _plan(), batch_size=12)
    # grain is imported only when it is needed, and its absence names the extra.
    monkeypatch.setitem(sys.modules, "grain", None)
    sampler = GrainSampler(100, batch_size=8)
    assert sampler.local_batch_size == 8
    with pytest.raises(BatchError, match=r"pip install eqxpar\[grain\]"):
        _ = sampler.shard_options
    with pytest.raises(BatchError, match=r"pip install eqxpar\[grain\]"):
        eqxpar.data.grain_loader(np.zeros((100, 3)), _plan(), batch_size=8)


_FEED = """
import json, sys
import eqxpar.distributed as dist
dist.initialize()
import numpy as np
import eqxpar, eqxpar.data

class Recording(eqxpar.data.TokenFile):
    reads = []

    def read(self, indices):
        self.reads.append(np.asarray(indices).tolist())
        return super().read(indices)

path, out = sys.argv[1], sys.argv[2]
tokens = Recording(path, seq_len=9, dtype=np.uint16)
plan = eqxpar.Plan(eqxpar.make_mesh(data=-1))
it = eqxpar.data.ShardedIterator(tokens, plan, batch_size=16, seed=5)
batches = [next(it).tolist() for _ in range(20)]
rows = eqxpar.data.process_slice(16, plan)
result = {"rows": [rows.start, rows.stop], "batches": batches, "reads": Recording.reads,
          "global": [it.global_indices(s).tolist() for s in range(20)]}
try:
    import grain  # noqa: F401
    loader = iter(eqxpar.data.grain_loader(tokens, plan, batch_size=16, seed=5))
    result["grain"] = [next(loader).tolist() for _ in range(20)]
except ImportError:
    pass
with open(f"{out}.{dist.process_index()}", "w") as f:
    json.dump(result, f)
"""


def test_two_processes_read_their_halves_of_the_same_global_batches(tmp_path, monkeypatch):
    path = _write(tmp_path, np.random.default_rng(1).integers(0, 60_000, size=3000))
    script = tmp_path / "feed.py"
    script.write_text(textwrap.dedent(_FEED))
    monkeypatch.setenv("XLA_FLAGS", suite_xla_flags())
    for processes, devices in ((1, 8), (2, 4)):
        out = tmp_path / f"out{processes}"
        code = eqxpar.launch.run(
            script, [str(path), str(out)], processes=processes, devices_per_process=devices, timeout=120
        )
        assert code == 0
    one = json.loads((tmp_path / "out1.0").read_text())
    halves = [json.loads((tmp_path / f"out2.{rank}").read_text()) for rank in range(2)]
    assert one["rows"] == [0, 16] and [h["rows"] for h in halves] == [[0, 8], [8, 16]]
    for step in range(20):
        assert halves[0]["global"][step] == halves[1]["global"][step] == one["global"][step]
        both = halves[0]["batches"][step] + halves[1]["batches"][step]
        assert both == one["batches"][step]
        for rank, half in enumerate(halves):
            # Each process read its 8 sequences of the step, and nothing else.
            assert half["reads"][step] == one["global"][step][8 * rank : 8 * rank + 8]
            if "grain" in half:
                assert half["grain"][step] == half["batches"][step]
    assert len(halves[0]["reads"]) == 20
    # Where grain is installed, the run compared its loader's batches too.
    assert ("grain" in halves[0]) == (importlib.util.find_spec("grain") is not None)
