"""Throughput and MFU: dense peaks in the device profiles, model FLOPs per token of
a GPT (by hand, and against the matmuls of a compiled step), the loop's
`Throughput` meter, and `eqxpar.inspect.trace`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig, flops_per_token, lm_loss, transformer_flops_per_token

from ._helpers import mse_loss, regression_batches

H100 = eqxpar.DEVICE_PROFILES["h100"]


def _profile(**more):
    fields = dict(
        name="x",
        flops_per_s={"float32": 1e12, "bfloat16": 2e12},
        hbm_bytes_per_s=1e12,
        intra_node_bytes_per_s=1e11,
        inter_node_bytes_per_s=1e10,
        devices_per_node=8,
        memory_bytes=2**30,
    )
    return eqxpar.DeviceProfile(**{**fields, **more})


# -- peaks ---------------------------------------------------------------------


def test_peaks_are_dense_and_the_measured_rates_are_unchanged():
    assert H100.peak("bfloat16") == H100.peak(jnp.bfloat16) == 989.4e12  # not the sparse 1979e12
    assert H100.peak("float16") == 989.4e12 and H100.peak("float8_e4m3fn") == 1978.9e12
    assert H100.peak(jnp.float32) == H100.peak("tfloat32") == 494.7e12
    assert eqxpar.DEVICE_PROFILES["tpu_v5p"].peak("bfloat16") == 459e12
    # The advisor's rates are the measured ones, as before.
    assert H100.flops("bfloat16") == 681.8e12 and H100.flops("float32") == 357.9e12
    for profile in eqxpar.DEVICE_PROFILES.values():
        for dtype, rate in profile.flops_per_s.items():
            if profile.peak_flops_per_s is None or dtype in profile.peak_flops_per_s:
                assert profile.peak(dtype) >= rate, (profile.name, dtype)
    # No published peak: the measured rates.
    cpu = eqxpar.DEVICE_PROFILES["cpu"]
    assert cpu.peak_flops_per_s is None and cpu.peak(jnp.bfloat16) == cpu.flops("bfloat16") != cpu.flops(
        "float32"
    )


def test_peak_errors_name_the_fix():
    with pytest.raises(eqxpar.PlanError, match=r"peak\('float32'\).*lists \['bfloat16'\]"):
        eqxpar.DEVICE_PROFILES["tpu_v5p"].peak("float32")
    with pytest.raises(eqxpar.PlanError, match="above its peak"):
        _profile(peak_flops_per_s={"bfloat16": 1e12})  # measured 2e12
    with pytest.raises(eqxpar.PlanError, match="peak_flops_per_s"):
        _profile(peak_flops_per_s={"bfloat16": -1.0})
    with pytest.raises(eqxpar.PlanError, match="peak_flops_per_s"):
        _profile(peak_flops_per_s={})
    assert _profile(peak_flops_per_s={"bfloat16": 4e12}).peak("bfloat16") == 4e12


# -- model FLOPs per token -------------------------------------------------------------


def test_flops_per_token_by_hand():
    # Dense, grouped-query (2 of 4 heads for K and V), SwiGLU, untied head.
    c = GPTConfig(
        vocab_size=100, d_model=64, num_heads=4, num_kv_heads=2, num_layers=3, d_hidden=96, tied=False
    )
    qkvo = 64 * 64 + 2 * 64 * 32 + 64 * 64  # head_dim 16: K and V are 2 x 16 = 32 wide
    per_token = 3 * (qkvo + 3 * 64 * 96) + 64 * 100
    attention = 12 * 3 * 40 * 4 * 16
    assert flops_per_token(c, seq_len=40, causal=False) == 6 * per_token + attention
    assert flops_per_token(c, seq_len=40) == 6 * per_token + attention // 2
    # Default: the longest sequence the model takes.
    assert flops_per_token(c) == flops_per_token(c, seq_len=c.max_seq_len)

    # GELU (2 matrices), tied: the head's matmul counts, the embedding lookup not.
    g = GPTConfig(
        vocab_size=50, d_model=32, num_heads=2, num_layers=2, d_hidden=128, activation="gelu", fused_qkv=True
    )
    assert (
        flops_per_token(g, seq_len=8) == 6 * (2 * (4 * 32 * 32 + 2 * 32 * 128) + 32 * 50) + 6 * 2 * 8 * 2 * 16
    )

    # MoE every 2nd of 4 blocks, 8 experts, top-2, one shared expert: per MoE block
    # the router (32 x 8) and 2 + 1 expert MLPs; dense blocks one MLP.
    m = GPTConfig(
        vocab_size=64, d_model=32, num_heads=4, num_layers=4, d_hidden=48, moe_every=2, experts=8,
        top_k=2, num_shared_experts=1,
    )  # fmt: skip
    mlp = 3 * 32 * 48
    blocks = 4 * (4 * 32 * 32) + 2 * mlp + 2 * (32 * 8 + 3 * mlp)
    assert flops_per_token(m, seq_len=16) == 6 * (blocks + 32 * 64) + 6 * 4 * 16 * 4 * 8


def test_transformer_flops_per_token_and_errors():
    assert (
        transformer_flops_per_token(matmul_params=1000, num_layers=2, seq_len=10, num_heads=3, head_dim=4)
        == 6 * 1000 + 6 * 2 * 10 * 3 * 4
    )
    with pytest.raises(eqxpar.PlanError, match="seq_len=0"):
        transformer_flops_per_token(matmul_params=1, num_layers=1, seq_len=0, num_heads=1, head_dim=1)
    c = GPTConfig(vocab_size=16, d_model=16, num_heads=2, num_layers=1, d_hidden=16, max_seq_len=32)
    with pytest.raises(eqxpar.PlanError, match="max_seq_len=32"):
        flops_per_token(c, seq_len=33)


@pytest.mark.parametrize(
    "config",
    [
        # Dense, grouped-query, untied.
        GPTConfig(vocab_size=48, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=64,
                  tied=False, attention="dense", max_seq_len=16),
        # MoE, GELU, a shared expert; capacity 1.0 with tokens * top_k a multiple of
        # the experts, so each expert runs exactly its share.
        GPTConfig(vocab_size=48, d_model=32, num_heads=4, num_layers=2, d_hidden=64, activation="gelu",
                  moe_every=2, experts=4, top_k=2, num_shared_experts=1, capacity_factor=1.0,
                  attention="dense", max_seq_len=16),
    ],
    ids=["dense-gqa", "moe"],
)  # fmt: skip
def test_flops_per_token_matches_the_compiled_matmuls(config):
    # One device, no remat, a dense attention kernel (the masked scores are
    # computed too): the compiled forward + backward runs exactly the non-causal
    # count. Dropless MoE would not agree: XLA:CPU runs ragged_dot as every row
    # against every expert.
    batch, seq = 2, 16
    model = GPT(config, key=jax.random.key(0))
    tokens = jnp.zeros((batch, seq + 1), jnp.int32)
    compiled = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss)).lower(model, tokens).compile()
    expected = flops_per_token(config, seq_len=seq, causal=False) * batch * seq
    assert eqxpar.inspect.matmul_flops(compiled) == expected


# -- Throughput --------------------------------------------------------------------


class FakeClock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_throughput_counts_after_warmup():
    clock = FakeClock(0.0, 10.0, 10.5, 11.5, 20.0, 21.0)
    meter = eqxpar.train.Throughput(
        tokens_per_step=1000, flops_per_token=3e6, device="h100", devices=4, dtype="bfloat16", clock=clock
    )
    x = jnp.ones(3)
    assert meter.tick(x) is None  # the compiling step: 10 s
    now = meter.tick(x)
    assert now["step_seconds"] == pytest.approx(0.5)
    assert now["tokens_per_s"] == pytest.approx(2000.0)
    assert now["tokens_per_s_per_device"] == pytest.approx(500.0)
    assert now["model_flops_per_s"] == pytest.approx(6e9)
    assert now["mfu"] == pytest.approx(6e9 / (4 * 989.4e12))
    meter.tick({"loss": x})
    meter.start()  # an evaluation ran from 11.5 to 20: left out
    meter.tick(x)
    assert meter.warmup_seconds == [10.0] and meter.steps == 3
    summary = meter.summary()
    assert summary["steps"] == 3 and summary["step_seconds"] == pytest.approx(2.5 / 3)
    assert summary["tokens_per_s"] == pytest.approx(3000 / 2.5)
    assert summary["mfu"] == pytest.approx(3000 / 2.5 * 3e6 / (4 * 989.4e12))
    assert not meter.peak_is_measured


def test_throughput_waits_for_the_outputs_before_reading_the_clock(monkeypatch):
    events = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append("wait") or real(x))

    def clock():
        events.append("clock")
        return float(len(events))

    meter = eqxpar.train.Throughput(
        tokens_per_step=8, flops_per_token=1.0, device="cpu", devices=1, warmup=0, clock=clock
    )
    meter.tick(jnp.ones(2))
    assert events == ["clock", "wait", "clock"]
    assert meter.peak_is_measured and meter.peak_flops_per_s == eqxpar.DEVICE_PROFILES["cpu"].flops(
        "bfloat16"
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tokens_per_step": 0}, "tokens_per_step=0"),
        ({"flops_per_token": float("nan")}, "flops_per_token=nan"),
        ({"device": "a100"}, "device='a100'"),
        ({"devices": 0}, "devices=0"),
        ({"warmup": -1}, "warmup=-1"),
        ({"device": "tpu_v5p", "dtype": "float32"}, r"peak\('float32'\)"),
    ],
)
def test_throughput_errors(kwargs, match):
    args = {"tokens_per_step": 8, "flops_per_token": 1.0, "device": "h100", "devices": 1, **kwargs}
    with pytest.raises(eqxpar.PlanError, match=match):
        eqxpar.train.Throughput(**args)


def test_throughput_refuses_to_time_nothing():
    meter = eqxpar.train.Throughput(tokens_per_step=8, flops_per_token=1.0, device="h100", devices=1)
    with pytest.raises(eqxpar.PlanError, match="no step counted yet"):
        meter.summary()
    with pytest.raises(eqxpar.PlanError, match=r"given float.*metrics\['loss'\]"):
        meter.tick(1.0)


# -- trace ---------------------------------------------------------------------------


def test_trace_writes_an_xplane_and_returns_the_advanced_state(tmp_path):
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    optimizer = optax.sgd(0.1)
    model = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(0))
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(mse_loss, optimizer, plan)
    batch = eqxpar.shard_batch(regression_batches(1)[0], plan)
    state, path = eqxpar.inspect.trace(step, state, batch, tmp_path / "trace", steps=2)
    assert int(state.step) == 3  # one warm-up step, two traced
    assert path.name.endswith(".xplane.pb") and path.stat().st_size > 0
    assert path.parent.parent == tmp_path / "trace" / "plugins" / "profile"
    with pytest.raises(eqxpar.PlanError, match="steps=0"):
        eqxpar.inspect.trace(step, state, batch, tmp_path, steps=0)
    with pytest.raises(eqxpar.PlanError, match="expected a tuple"):
        eqxpar.inspect.trace(lambda s, b: s, state, batch, tmp_path, warmup=1)
