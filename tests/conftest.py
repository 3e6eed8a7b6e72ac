"""Test set-up: 8 simulated CPU devices, strict rank promotion.

XLA_FLAGS must be set before JAX starts its first backend, so it is set here, in
the first module pytest imports.
"""

import os

# 8 simulated devices; XLA:CPU running each device's collectives in program order
# (plans manual over several axes need it: see eqxpar.train.make_step); and cheap
# code generation (no LLVM optimisation, XLA:CPU's elemental emitter for fused
# elementwise ops), as the plan fuzz's workers use. The suite compiles hundreds of
# small programs and runs each a few times, so compiling is most of its time and
# generating machine code most of compiling. The HLO passes that partition the
# program and place its collectives, hence every collective and byte count the
# tests read, are the same; results are compared with one device compiled alike.
# Examples and scripts the tests run as subprocesses inherit the flags.
# jaxlib releases drop flags (the fusion-emitter switch is gone from 0.12) and XLA
# aborts on one it does not know, so only the flags this jaxlib knows are passed.
# Importing eqxpar imports JAX but starts no backend, and XLA reads XLA_FLAGS when
# the first backend starts, so setting them after the import below still counts.
from eqxpar.runtime import supported_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        *supported_xla_flags(
            [
                "--xla_force_host_platform_device_count=8",
                "--xla_cpu_enable_concurrency_optimized_scheduler=false",
                "--xla_backend_optimization_level=0",
                "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false",
            ]
        ),
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# Rank promotion is a silent-bug source in parallel code (a dropped batch axis
# broadcasts instead of failing); dtype promotion stays "standard" because optax's
# own update code mixes Python floats and int32 counters, which "strict" rejects.
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
    if jax.device_count() < 8:
        skip = pytest.mark.skip(reason=f"needs 8 devices, have {jax.device_count()}")
        for item in items:
            item.add_marker(skip)
