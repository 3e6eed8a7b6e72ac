"""eqxpar.data.PackedTokens: documents split at an end-of-document id, packed into
fixed-length rows with segment ids, positions and loss weights, fed by
ShardedIterator (deterministic, resumable, each process its own rows).

The documents are found here independently of the packer (numpy splits of the
ids), and every check reads the rows the packer yields against them. One test
runs a script as 2 processes x 4 devices through eqxpar.launch and compares
their rows with the single-process stream.
"""

import collections
import json
import pickle
import textwrap

import numpy as np
import pytest

import eqxpar
import eqxpar.launch
from eqxpar import BatchError
from eqxpar.data import PackedTokens, ShardedIterator, TokenFile

from ._compile_flags import suite_xla_flags

EOD = 0


def _ids(documents=60, longest=30, seed=0, vocab=100):
    """Ids of `documents` documents of 1 to `longest` ids, each ending with EOD,
    and a last one without it."""
    rng = np.random.default_rng(seed)
    parts = [np.append(rng.integers(1, vocab, size=rng.integers(0, longest)), EOD) for _ in range(documents)]
    parts.append(rng.integers(1, vocab, size=5))
    return np.concatenate(parts).astype(np.int32)


def _documents(ids):
    """The documents, split here after each EOD (the packer's own split is not used)."""
    cuts = np.flatnonzero(ids == EOD) + 1
    return [d for d in np.split(ids, cuts) if d.size]


def _all_rows(packed):
    return packed.read(np.arange(len(packed)))


def test_row_format_of_a_small_example():
    ids = np.array([5, 6, 7, 0, 8, 9, 0, 3, 0])
    packed = PackedTokens(ids, eod_id=0, seq_len=5)
    rows = _all_rows(packed)
    assert (len(packed), packed.num_documents, packed.seq_len, packed.eod_id) == (2, 3, 5, 0)
    assert set(rows) == {"tokens", "segment_ids", "positions", "weights"}
    assert [rows[k].dtype for k in rows] == [np.int32, np.int32, np.int32, np.float32]
    # Sequential: document 2 (3 ids) does not fit the 2 left in row 0, which is padded.
    assert rows["tokens"].tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 0, 3, 0, 0]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 0]]
    assert rows["positions"].tolist() == [[0, 1, 2, 3, 0, 0], [0, 1, 2, 0, 1, 0]]
    assert rows["weights"].tolist() == [[0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 0]]
    assert packed.fill == pytest.approx(9 / 12)
    # First fit over 2 open rows: document 3 goes back into row 0's room.
    first_fit = _all_rows(PackedTokens(ids, eod_id=0, seq_len=5, open_rows=2))
    assert first_fit["tokens"].tolist() == [[5, 6, 7, 0, 3, 0], [8, 9, 0, 0, 0, 0]]
    # Filled rows: document 2 continues in the next row from its last placed id.
    filled = PackedTokens(ids, eod_id=0, seq_len=5, split="always")
    rows = _all_rows(filled)
    assert rows["tokens"].tolist() == [[5, 6, 7, 0, 8, 9], [9, 0, 3, 0, 0, 0]]
    assert rows["positions"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 0, 0]]
    assert rows["weights"].tolist() == [[0, 1, 1, 1, 0, 1], [0, 1, 0, 1, 0, 0]]
    assert filled.segments(1).tolist() == [[1, 1, 3], [2, 0, 2]]
    # Boundaries trained on: a document's first id, predicted from the one before it.
    unmasked = _all_rows(PackedTokens(ids, eod_id=0, seq_len=5, mask_boundaries=False))
    assert unmasked["weights"].tolist() == [[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]]
    # Truncated: a document longer than a row keeps its first row's worth.
    truncated = PackedTokens(ids, eod_id=0, seq_len=2, split="never")
    assert _all_rows(truncated)["tokens"].tolist() == [[5, 6, 7], [8, 9, 0], [3, 0, 0]]
    assert PackedTokens(ids, eod_id=0, seq_len=5, drop_last=True).read([0])["tokens"].tolist() == [
        [5, 6, 7, 0, 0, 0]
    ]
    assert len(PackedTokens(ids, eod_id=0, seq_len=5, drop_last=True)) == 1


def _check_rows(packed, rows, mask_boundaries):
    """The row invariants: segments numbered 1, 2, ... from the left with padding
    (0) only at the end, positions restarting at 0 in each segment, and a weight
    of 1 exactly on the ids predicted from the id before them in their segment."""
    seg, pos, w = rows["segment_ids"], rows["positions"], rows["weights"]
    starts = np.ones_like(seg, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    real = seg > 0
    assert (seg[:, 0] == 1).all()
    assert np.isin(np.diff(seg, axis=1)[real[:, 1:]], (0, 1)).all()  # the same segment or the next
    assert not (~real[:, :-1] & real[:, 1:]).any()  # padding only at the end
    expected_pos = np.zeros_like(pos)
    for r in range(seg.shape[0]):
        for c in range(1, seg.shape[1]):
            expected_pos[r, c] = 0 if starts[r, c] else expected_pos[r, c - 1] + 1
    np.testing.assert_array_equal(pos[real], expected_pos[real])
    assert (pos[~real] == 0).all() and (rows["tokens"][~real] == packed.eod_id).all()
    inside = real & ~starts
    if mask_boundaries:
        np.testing.assert_array_equal(w, inside.astype(np.float32))
    else:
        assert (w[inside] == 1).all() and (w[~real] == 0).all() and (w[:, 0] == 0).all()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"open_rows": 4},
        {"split": "always"},
        {"split": "never"},
        {"seed": 3, "open_rows": 2},
        {"mask_boundaries": False},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_rows_unpack_to_every_document_in_order(options):
    ids = _ids()
    documents = _documents(ids)
    seq_len = 15  # documents of up to 31 ids: some are split (or truncated)
    packed = PackedTokens(ids, eod_id=EOD, seq_len=seq_len, **options)
    rows = _all_rows(packed)
    assert rows["tokens"].shape == (len(packed), seq_len + 1) and packed.num_documents == len(documents)
    _check_rows(packed, rows, options.get("mask_boundaries", True))
    # Each segment is the ids of the piece of a document segments() names, and a
    # document's pieces, in order, overlap by one id and cover it (its first
    # seq_len + 1 ids when truncated).
    pieces = collections.defaultdict(list)
    for r in range(len(packed)):
        for k, (d, start, stop) in enumerate(packed.segments(r)):
            segment = rows["tokens"][r][rows["segment_ids"][r] == k + 1]
            np.testing.assert_array_equal(segment, documents[d][start:stop])
            pieces[int(d)].append((int(start), int(stop)))
    assert sorted(pieces) == list(range(len(documents)))
    for d, spans in pieces.items():
        spans.sort()
        end = min(len(documents[d]), seq_len + 1) if options.get("split") == "never" else len(documents[d])
        assert spans[0][0] == 0 and spans[-1][1] == end
        assert all(b[0] == a[1] - 1 for a, b in zip(spans, spans[1:], strict=False))
    if "seed" in options or "open_rows" in options:
        return
    # Sequential packing keeps the documents' order: the ids with weight 1, row
    # after row, are every document's ids after its first (its targets), in order,
    # each once.
    targets = rows["tokens"][rows["weights"] == 1]
    if options.get("mask_boundaries", True):
        end = seq_len + 1 if options.get("split") == "never" else None
        np.testing.assert_array_equal(targets, np.concatenate([d[1:end] for d in documents]))


def _examples(tokens, segment_ids, weights):
    """What a causal model with segment masking and restarting positions is trained
    on: each weighted target with the ids of its segment before it."""
    out = collections.Counter()
    for toks, seg, w in zip(tokens, segment_ids, weights, strict=True):
        for j in np.flatnonzero(w[1:]) + 1:
            start = j - 1
            while start > 0 and seg[start - 1] == seg[j]:
                start -= 1
            out[(tuple(toks[start:j].tolist()), int(toks[j]))] += 1
    return out


def test_packed_rows_train_each_document_as_one_row_padded():
    # The parity a packed batch must hold against one document per padded row,
    # model-free: the same (context, target) pairs, each once.
    ids = _ids(documents=40, longest=12)
    documents = _documents(ids)
    packer = PackedTokens(ids, eod_id=EOD, seq_len=15, open_rows=3)
    packed = _all_rows(packer)
    width = 16
    one_per_row = np.full((len(documents), width), EOD, np.int32)
    weights = np.zeros((len(documents), width), np.float32)
    for i, d in enumerate(documents):
        one_per_row[i, : len(d)] = d
        weights[i, 1 : len(d)] = 1
    segments = (np.arange(width) < np.array([[len(d)] for d in documents])).astype(np.int32)
    want = _examples(one_per_row, segments, weights)
    assert _examples(packed["tokens"], packed["segment_ids"], packed["weights"]) == want
    assert packed["weights"].sum() == weights.sum() == sum(len(d) - 1 for d in documents)
    # First fit over 3 open rows: 21 rows of 16 for 41 documents of 270 ids.
    assert packer.fill == pytest.approx(ids.size / packed["tokens"].size) and packer.fill > 0.75


def test_packing_is_deterministic_and_a_file_packs_as_its_array(tmp_path):
    ids = _ids(documents=200, longest=40)
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    tokens = TokenFile(path, seq_len=31, dtype=np.uint16)
    from_file = PackedTokens(tokens, eod_id=EOD, open_rows=8, seed=5)
    assert from_file.seq_len == 31
    for again in (
        PackedTokens(ids, eod_id=EOD, seq_len=31, open_rows=8, seed=5),
        PackedTokens(tokens, eod_id=EOD, open_rows=8, seed=5),
    ):
        for a, b in zip(_all_rows(from_file).values(), _all_rows(again).values(), strict=True):
            np.testing.assert_array_equal(a, b)
    other = PackedTokens(tokens, eod_id=EOD, open_rows=8, seed=6)
    assert not np.array_equal(_all_rows(other)["tokens"][:4], _all_rows(from_file)["tokens"][:4])
    # First fit pads less than sequential greedy packing.
    assert from_file.fill > PackedTokens(tokens, eod_id=EOD).fill
    one = from_file[3]
    for name, value in from_file.read([3]).items():
        np.testing.assert_array_equal(one[name], value[0])
    last = from_file.read([len(from_file) - 1])["tokens"]
    np.testing.assert_array_equal(from_file.read([-1])["tokens"], last)
    # A grain worker gets the file's path and the layout, and reads the same rows.
    copy = pickle.loads(pickle.dumps(from_file))
    for a, b in zip(from_file.read([0, 9]).values(), copy.read([0, 9]).values(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert repr(copy) == repr(from_file)


def test_a_row_reads_only_its_pieces(tmp_path):
    class Recording(TokenFile):
        spans = []

        def read_spans(self, starts, stops):
            self.spans.append(list(zip(np.asarray(starts).tolist(), np.asarray(stops).tolist(), strict=True)))
            return super().read_spans(starts, stops)

    ids = _ids(documents=100)
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    packed = PackedTokens(Recording(path, seq_len=15, dtype=np.uint16), eod_id=EOD)
    Recording.spans.clear()
    packed.read([7])
    (spans,) = Recording.spans
    assert sum(b - a for a, b in spans) == packed.read([7])["segment_ids"].astype(bool).sum()
    assert len(spans) == len(packed.segments(7))


def test_iterator_over_packed_rows_resumes_and_does_not_depend_on_the_mesh(tmp_path):
    packed = PackedTokens(_ids(documents=150), eod_id=EOD, seq_len=15, open_rows=4)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    it = ShardedIterator(packed, plan, batch_size=8, seed=1)
    steps = it.steps_per_epoch + 3  # across an epoch boundary
    seen = []
    for step in range(steps):
        batch = next(it)
        want = packed.read(it.global_indices(step))
        assert set(batch) == set(want)
        for name in want:
            np.testing.assert_array_equal(batch[name], want[name])
        seen.append(batch)
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"step": steps, "seed": 1}
    expected = [next(it) for _ in range(3)]
    resumed = ShardedIterator(packed, plan, batch_size=8, seed=0)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    other = ShardedIterator(packed, eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4)), batch_size=8, seed=1)
    for step in (0, steps - 1):
        np.testing.assert_array_equal(other.global_indices(step), it.global_indices(step))
    # The rows feed a train step as one global batch (a dict of four arrays).
    batch = eqxpar.data.global_batch(seen[0], plan)
    assert {name: value.shape for name, value in batch.items()} == {name: (8, 16) for name in batch}


def test_packed_data_state_round_trips_through_a_checkpoint(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp

    import eqxpar.checkpoint

    packed = PackedTokens(_ids(documents=80), eod_id=EOD, seq_len=15)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    it = ShardedIterator(packed, plan, batch_size=8, seed=3)
    for _ in range(4):
        next(it)
    manager = eqxpar.checkpoint.CheckpointManager(tmp_path / "ckpt")
    manager.save(4, {"w": jnp.zeros(2)}, data_state=it.get_state())
    manager.wait()
    _, data_state = manager.restore(like={"w": jnp.zeros(2)}, plan=plan)
    manager.close()
    resumed = ShardedIterator(PackedTokens(_ids(documents=80), eod_id=EOD, seq_len=15), plan, batch_size=8)
    resumed.set_state(data_state)
    want, got = next(it), next(resumed)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_grain_loader_yields_the_packed_rows():
    pytest.importorskip("grain")
    packed = PackedTokens(_ids(documents=150), eod_id=EOD, seq_len=15, open_rows=2)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2))
    reference = ShardedIterator(packed, plan, batch_size=8, seed=2)
    loader = iter(eqxpar.data.grain_loader(packed, plan, batch_size=8, seed=2))
    for _ in range(5):
        want, got = next(reference), next(loader)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_bad_inputs_name_the_value(tmp_path):
    ids = _ids(documents=10)
    with pytest.raises(BatchError, match=r"eod_id=100 is outside the vocabulary of vocab_size=100"):
        PackedTokens(ids, eod_id=100, seq_len=8, vocab_size=100)
    with pytest.raises(BatchError, match=r"eod_id=-1 is not a token id"):
        PackedTokens(ids, eod_id=-1, seq_len=8)
    with pytest.raises(BatchError, match=r"eod_id=True is not a token id"):
        PackedTokens(ids, eod_id=True, seq_len=8)
    with pytest.raises(BatchError, match=r"eod_id=70000 cannot occur in ids of type uint16"):
        PackedTokens(ids.astype(np.uint16), eod_id=70000, seq_len=8)
    with pytest.raises(BatchError, match=r"eod_id=7 never occurs in the 4 token ids"):
        PackedTokens(np.array([1, 2, 3, 4]), eod_id=7, seq_len=2)
    with pytest.raises(BatchError, match=r"token id 150 at position 2 is outside the vocabulary \[0, 100\)"):
        PackedTokens(np.array([1, 0, 150, 0]), eod_id=0, seq_len=2, vocab_size=100)
    with pytest.raises(BatchError, match=r"token id -3 at position 1 is outside \[0, 2147483647\]"):
        PackedTokens(np.array([1, -3, 0]), eod_id=0, seq_len=2)
    for seq_len in (0, -4, 2.5, None):
        with pytest.raises(BatchError, match=rf"seq_len={seq_len} gives rows of seq_len \+ 1 ids.*least 2"):
            PackedTokens(ids, eod_id=EOD, seq_len=seq_len)
    with pytest.raises(BatchError, match=r"split='some' is not one of \('long', 'always', 'never'\)"):
        PackedTokens(ids, eod_id=EOD, seq_len=8, split="some")
    with pytest.raises(BatchError, match=r"open_rows=3 needs split='long' or 'never'"):
        PackedTokens(ids, eod_id=EOD, seq_len=8, split="always", open_rows=3)
    with pytest.raises(BatchError, match=r"open_rows=0 is not valid"):
        PackedTokens(ids, eod_id=EOD, seq_len=8, open_rows=0)
    with pytest.raises(BatchError, match=r"vocab_size=0 is not valid"):
        PackedTokens(ids, eod_id=EOD, seq_len=8, vocab_size=0)
    with pytest.raises(BatchError, match=r"float32 array of shape \(10,\).*one flat integer array"):
        PackedTokens(np.zeros(10, np.float32), eod_id=EOD, seq_len=8)
    with pytest.raises(BatchError, match=r"int64 array of shape \(2, 5\)"):
        PackedTokens(np.zeros((2, 5), np.int64), eod_id=EOD, seq_len=8)
    with pytest.raises(BatchError, match=r"drop_last=True dropped every row: the 2 documents \(4 ids\)"):
        PackedTokens(np.array([1, 0, 2, 0]), eod_id=0, seq_len=8, drop_last=True)
    packed = PackedTokens(ids, eod_id=EOD, seq_len=8)
    with pytest.raises(IndexError, match=rf"row {len(packed)} is out of range; there are {len(packed)} rows"):
        packed.read([0, len(packed)])
    path = tmp_path / "ids.bin"
    ids.astype(np.uint16).tofile(path)
    tokens = TokenFile(path, seq_len=8, dtype=np.uint16)
    with pytest.raises(BatchError, match=rf"span \[5, {ids.size + 1}\) is not inside the file's {ids.size}"):
        tokens.read_spans([0, 5], [3, ids.size + 1])
    with pytest.raises(BatchError, match="2 starts but 1 stops"):
        tokens.read_spans([0, 5], [3])
    np.testing.assert_array_equal(tokens.read_spans([0, 5], [3, 7]), np.concatenate([ids[0:3], ids[5:7]]))


_FEED = """
import json, sys
import eqxpar.distributed as dist
dist.initialize()
import numpy as np
import eqxpar, eqxpar.data

tokens = eqxpar.data.TokenFile(sys.argv[1], seq_len=15, dtype=np.uint16)
packed = eqxpar.data.PackedTokens(tokens, eod_id=0, open_rows=4, seed=1)
plan = eqxpar.Plan(eqxpar.make_mesh(data=-1))
it = eqxpar.data.ShardedIterator(packed, plan, batch_size=16, seed=5)
batches = [{k: v.tolist() for k, v in next(it).items()} for _ in range(12)]
rows = eqxpar.data.process_slice(16, plan)
with open(f"{sys.argv[2]}.{dist.process_index()}", "w") as f:
    json.dump({"rows": [rows.start, rows.stop], "batches": batches}, f)
"""


def test_two_processes_read_their_rows_of_the_single_process_stream(tmp_path, monkeypatch):
    ids = _ids(documents=300)
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    script = tmp_path / "feed.py"
    script.write_text(textwrap.dedent(_FEED))
    monkeypatch.setenv("XLA_FLAGS", suite_xla_flags())
    out = tmp_path / "out"
    code = eqxpar.launch.run(script, [str(path), str(out)], processes=2, devices_per_process=4, timeout=120)
    assert code == 0
    halves = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
    assert [h["rows"] for h in halves] == [[0, 8], [8, 16]]
    # The single-process stream, here (1 process x 8 devices).
    packed = PackedTokens(TokenFile(path, seq_len=15, dtype=np.uint16), eod_id=0, open_rows=4, seed=1)
    one = ShardedIterator(packed, eqxpar.Plan(eqxpar.make_mesh(data=8)), batch_size=16, seed=5)
    for step in range(12):
        want = next(one)
        for name, value in want.items():
            both = halves[0]["batches"][step][name] + halves[1]["batches"][step][name]
            np.testing.assert_array_equal(np.asarray(both), value, err_msg=f"step {step} {name}")
        # Disjoint: the two processes' rows of a step are different packed rows.
        mine = [one.global_indices(step)[8 * r : 8 * r + 8] for r in range(2)]
        assert not set(mine[0].tolist()) & set(mine[1].tolist())
