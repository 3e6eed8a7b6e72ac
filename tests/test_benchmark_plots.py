"""The benchmark plots (`benchmarks.plots`) and the scaling sweep's tables
(`benchmarks.scaling`), on small fixtures: nothing is measured."""

import json
import math

import pytest

pytest.importorskip("matplotlib")

from benchmarks import _workload, plots, report, scaling  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    return path.exists() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def _record(strategy: str, **fields) -> dict:
    # The fields of a benchmarks.run record that the plots read.
    return {
        "strategy": strategy,
        "mesh": {"data": 8},
        "step_time_s": 1.1,
        "baseline_step_time_s": 1.0,
        "comm_wire_bytes_total": 24_181_255,
        "comm_wire_bytes_min": 24_181_248,
        "comm_wire_bytes_baseline": 36_237_831,
        "mem_argument_bytes": 40 * 2**20,
        "mem_temp_bytes": 60 * 2**20,
        **fields,
    }


FIXTURE = {
    "jax": "0.10.2",
    "records": [
        _record("dp", baseline="hand-written jax.jit step with the same shardings, float32 (no casts)"),
        # No baseline at all: a gap in comm.png, left out of step_ratio.png.
        _record("tp_sp", baseline=None, comm_wire_bytes_baseline=None, baseline_step_time_s=None),
        _record(
            "pp_1f1b",
            baseline="GPipe",
            memory_sweep=[
                {"microbatches": 8, "mem_temp_bytes": 90 * 2**20, "mem_argument_bytes": 30 * 2**20},
                {"microbatches": 4, "mem_temp_bytes": 80 * 2**20, "mem_argument_bytes": 30 * 2**20},
                {"microbatches": 16, "mem_temp_bytes": 95 * 2**20},
            ],
        ),
        _record(
            "pp_gpipe", baseline="GPipe", memory_sweep=[{"microbatches": 4, "mem_temp_bytes": 160 * 2**20}]
        ),
    ],
}


def test_plots_render_all_three_pngs(tmp_path):
    path = tmp_path / "quick.json"
    path.write_text(json.dumps(FIXTURE))
    written = plots.main(["--json", str(path), "--out", str(tmp_path / "out")])
    assert written == {"comm.png": True, "step_ratio.png": True, "pipeline_memory.png": True}
    for name in written:
        assert _is_png(tmp_path / "out" / name), name


def test_pipeline_memory_is_skipped_without_sweeps(tmp_path, capsys):
    path = tmp_path / "quick.json"
    path.write_text(
        json.dumps(
            {"records": [_record("dp", baseline="jax.jit"), _record("fsdp_manual", baseline="jax.jit")]}
        )
    )
    written = plots.main(["--json", str(path), "--out", str(tmp_path)])
    assert written["pipeline_memory.png"] is False
    assert not (tmp_path / "pipeline_memory.png").exists()
    assert "skipped pipeline_memory.png" in capsys.readouterr().out


def test_plots_of_no_records_draw_nothing(tmp_path):
    assert plots.write_all({"records": []}, tmp_path) == dict.fromkeys(plots.PLOTS, False)
    # Only records without a baseline time: nothing to divide by.
    assert not plots.plot_step_ratio([_record("x", baseline_step_time_s=None)], tmp_path / "r.png")
    assert [p.name for p in tmp_path.iterdir()] == []


def test_memory_sweep_orders_points():
    record = FIXTURE["records"][2]
    assert plots.memory_sweep(record) == [(4, 80 * 2**20), (8, 90 * 2**20), (16, 95 * 2**20)]


def test_missing_matplotlib_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install -e \.\[examples\]"):
        plots.figure()


def _point(sweep: str, strategy: str, mesh: dict, d_model: int = 256, **fields) -> dict:
    # A scaling record (the fields the plots and tables read) with made-up numbers
    # that scale the way the real ones should.
    n = math.prod(mesh.values())
    params = 3_454_464 * (d_model // 256) ** 2
    wire = 2 * (n - 1) * params * 4 // n
    return {
        "sweep": sweep,
        "strategy": strategy,
        "mesh": {k: v for k, v in mesh.items() if v > 1},
        "devices": n,
        "d_model": d_model,
        "params": params,
        "comm_wire_bytes_total": wire,
        "comm_wire_bytes_min": wire,
        "wire_over_min": 1.0,
        "mem_argument_bytes": 3 * params * 4 // (n if strategy == "fsdp_manual" else 1),
        "mem_temp_bytes": 500 * 2**20 // n,
        "step_time_ratio": 1.1,
        "reference": scaling.SINGLE_REFERENCE if sweep == "devices" else scaling.SAME_SHARDINGS_REFERENCE,
        **fields,
    }


def test_config_scales_mlp_with_width():
    cfg = scaling.config(512)
    assert (cfg.d_model, cfg.mlp, cfg.heads, cfg.layers) == (512, 2048, 4, 4)
    assert scaling.config(256) == _workload.CONFIG


def test_scaling_plots_and_tables(tmp_path):
    devices = [
        _point("devices", s, {axis: n})
        for s, axis in (("dp", "data"), ("fsdp_manual", "fsdp"))
        for n in (1, 2, 4, 8)
    ]
    width = [
        _point("width", s, {axis: 8}, d, comm_wire_bytes_baseline=36_000_000)
        for s, axis in (("dp", "data"), ("fsdp_manual", "fsdp"))
        for d in (128, 256, 512)
    ]
    data = {
        "command": "python -m benchmarks.scaling --quick",
        "jax": "0.10.2",
        "cpu_count": 2,
        "wall_time_s": 600.0,
        "devices_sweep": devices,
        "width_sweep": width,
        "single_device": {"d_model": 256, "mem_argument_bytes": 40 * 2**20, "mem_temp_bytes": 555 * 2**20},
    }
    page = tmp_path / "S.md"
    page.write_text("# Hand-written\n")
    pngs = [tmp_path / "scaling_devices.png", tmp_path / "scaling_width.png"]
    assert scaling.write_outputs(data, tmp_path, page) == [*pngs, page]
    assert all(_is_png(png) for png in pngs)
    text = page.read_text()
    assert text.startswith("# Hand-written\n") and report.BEGIN in text
    assert text.count("| fsdp_manual |") == 7
    assert "| dp | data 8 | 256 | 3.45 | 24.18 | 24.18 | 1.0000 |" in text
    assert "| 40.0 | 555.0 |" in text  # the single-device reference's memory
    # Empty sweeps draw nothing and do not crash.
    assert not plots.plot_sweep([], tmp_path / "none.png", x="devices", xlabel="", title="")
    assert "| strategy |" in scaling.table([])
