"""Metric trackers: what `log` writes, read back as their readers read it."""

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest

import eqxpar

METRICS = {
    "loss": jnp.asarray(2.5, jnp.float32),
    "skipped": jnp.asarray(False),
    "aux": {"load": jnp.asarray([0.25, 0.75]), "big": jnp.zeros((100,))},
    "grad_norm": float("nan"),
}


def test_json_lines_write_one_record_per_step_and_append_on_restart(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    tracker = eqxpar.train.JsonLinesTracker(path)
    assert isinstance(tracker, eqxpar.train.Tracker)
    tracker.log(METRICS, step=1)
    tracker.close()
    again = eqxpar.train.JsonLinesTracker(path)  # a restarted run continues the file
    again.log({"loss": 1.5}, step=2)
    again.close()
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == {"step": 1, "loss": 2.5, "skipped": 0, "aux/load": [0.25, 0.75], "grad_norm": "nan"}
    assert second == {"step": 2, "loss": 1.5}


def _events(directory):
    """The Event protos of the TFRecord files in `directory`: 8-byte length, its CRC,
    the record, its CRC (the CRCs are not checked here)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for file in sorted(directory.iterdir()):
        data = file.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event()
            event.ParseFromString(data[at + 12 : at + 12 + length])
            out.append(event)
            at += 12 + length + 4
    return out


def test_tensorboard_event_files_hold_each_scalar(tmp_path):
    tracker = eqxpar.train.Trackers(
        [
            eqxpar.train.TensorBoardTracker(tmp_path / "tb"),
            eqxpar.train.JsonLinesTracker(tmp_path / "m.jsonl"),
        ]
    )
    tracker.log(METRICS, step=3)
    tracker.log({"loss": 2.0}, step=4)
    tracker.close()
    scalars = [(e.step, v.tag, v.simple_value) for e in _events(tmp_path / "tb") for v in e.summary.value]
    assert (3, "loss", 2.5) in scalars and (4, "loss", 2.0) in scalars
    assert (3, "skipped", 0.0) in scalars
    assert not any(tag.startswith("aux/") for _, tag, _ in scalars)  # arrays are not scalars
    assert np.isnan(next(v for s, tag, v in scalars if tag == "grad_norm"))
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
    with pytest.raises(eqxpar.EqxparError, match="log\\(metrics, step\\)"):
        eqxpar.train.Trackers([object()])
