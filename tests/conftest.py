"""Test set-up: 8 simulated CPU devices, strict rank promotion.

XLA_FLAGS must be set before jax is imported anywhere, so it is set here, at the
top of the first module pytest imports.
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
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
