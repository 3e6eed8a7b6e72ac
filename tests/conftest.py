"""Test set-up: 8 simulated CPU devices, strict rank promotion.

XLA_FLAGS must be set before JAX starts its first backend, so it is set here, in
the first module pytest imports.
"""

import fnmatch
import os

# No persistent JAX compilation cache: the suite's programs are nearly all distinct
# (each test traces its own loss and plan), so a cache would write every executable
# and read almost none back; measured, it made tests/test_models.py 15 % slower.
# A caller who sets JAX_COMPILATION_CACHE_DIR still gets one.
# 8 simulated devices, each running its collectives in program order, compiled
# cheaply: the flags, and why, are in tests/_compile_flags.py. Examples and scripts
# the tests run as subprocesses inherit them, or take them from there.
# Importing eqxpar imports JAX but starts no backend, and XLA reads XLA_FLAGS when
# the first backend starts, so setting them after this import still counts.
from ._compile_flags import DEVICES_8, IN_ORDER, suite_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), suite_xla_flags(DEVICES_8, IN_ORDER)]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the `tpu` extra, for tests/test_topology.py's TPU topologies) takes a lock
# file per process unless told that several processes (pytest-xdist's workers) may
# load it. JAX_PLATFORMS=cpu above keeps JAX from looking for an attached TPU, which
# with libtpu installed costs seconds per process on a machine without one.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Rank promotion is a silent-bug source in parallel code (a dropped batch axis
# broadcasts instead of failing); dtype promotion stays "standard" because optax's
# own update code mixes Python floats and int32 counters, which "strict" rejects.
jax.config.update("jax_numpy_rank_promotion", "raise")


#: Above this many memory maps a worker releases its compiled programs. XLA:CPU maps
#: each executable's code in regions of its own and jit's caches keep them all, so a
#: worker that compiles the suite's thousands of programs nears Linux's limit of
#: 65,530 maps (`vm.max_map_count`), and LLVM then aborts the process while compiling
#: ("Fatal Python error: Aborted" late in a run; seen once the suite grew by a few
#: dozen compiles per worker). Tests do not share compiled programs, so dropping them
#: costs nothing but the rare recompile.
_MAPS_BEFORE_RELEASE = 30_000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    if _memory_maps() > _MAPS_BEFORE_RELEASE:
        import gc

        gc.collect()
        jax.clear_caches()


#: Every node id collected in this process, before `-m` deselects any
#: (tests/test_slow_cases.py reads it).
COLLECTED: set[str] = set()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    from ._slow_cases import NEWEST, SLOW_CASES, kept_out

    if jax.device_count() < 8:
        skip = pytest.mark.skip(reason=f"needs 8 devices, have {jax.device_count()}")
        for item in items:
            item.add_marker(skip)
    SLOW_CASES.update(kept_out([item.nodeid for item in items]))
    for item in items:
        COLLECTED.add(item.nodeid)
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in NEWEST):
            item.add_marker(pytest.mark.newest)
