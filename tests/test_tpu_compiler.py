"""The options eqxpar hands the TPU compiler (`eqxpar/_tpu_compiler.py`): libtpu's
windowed gradient scatters off under FSDP x tensor over small FSDP groups only,
and `eqxpar.aot` compiling with them."""

import importlib.util

import pytest

import eqxpar
from eqxpar import aot
from eqxpar._parallel_dims import ParallelDims
from eqxpar._tpu_compiler import WINDOWED_SCATTERS, tpu_compiler_options

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to compile for',
)


def _options(sizes, **options):
    plan = aot.plan_of(sizes, topology=None, **options)
    return tpu_compiler_options(ParallelDims.of(plan), plan.mesh)


def test_windowed_gradient_scatters_go_off_under_fsdp_x_tensor_over_small_groups_only():
    # FSDP 2 x tensor 4: a ring's two extra shards are 2/1 of a scatter's bytes.
    assert _options({"fsdp": 2, "tensor": 4}) == {WINDOWED_SCATTERS: "false"}
    # Without tensor (the gradients would be all-reduced instead, 8B FSDP 32 on
    # v5p-64), with a manual step (eqxpar scatters them itself) or a pipeline, as
    # libtpu chooses.
    assert _options({"fsdp": 8}) == {}
    assert _options({"data": 2, "fsdp": 4}) == {}
    assert _options({"fsdp": 2, "tensor": 4}, mode="manual") == {}
    assert _options({"pipe": 2, "fsdp": 2, "tensor": 2}) == {}
    assert _options({"tensor": 8}) == {}


@needs_libtpu
def test_the_step_carries_the_options_into_every_compile(monkeypatch):
    """The step's own jit holds the options, so `eqxpar.aot`'s compile and a step
    run on attached chips are one program: an option libtpu does not know, put in
    their place, fails `compile_train_step`; the real one compiles; on this
    machine's devices the step asks for none."""
    config = eqxpar.models.preset(
        "gpt2", num_layers=1, max_seq_len=64, vocab_size=1024, d_model=256, num_heads=4, d_hidden=1024
    )
    plan = aot.plan_of({"fsdp": 2, "tensor": 4}, topology="v5p:2x2x2")
    report = aot.compile_train_step(config, plan, batch=(1, 32))
    assert report.refused is None
    monkeypatch.setattr("eqxpar._tpu_compiler.WINDOWED_SCATTERS", "xla_eqxpar_no_such_option")
    with pytest.raises(Exception, match="xla_eqxpar_no_such_option"):
        aot.compile_train_step(config, plan, batch=(1, 32))
    # On this machine's devices the step asks for none (the unknown option would fail).
    aot.compile_train_step(config, aot.plan_of({"fsdp": 2, "tensor": 4}, topology=None), batch=(1, 32))
