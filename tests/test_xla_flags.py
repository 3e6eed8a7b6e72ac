"""`eqxpar.runtime.supported_xla_flags`: only the flags the installed jaxlib knows
reach XLA, which aborts the process on any other."""

import json
import os
import subprocess
import sys

from eqxpar.runtime import supported_xla_flags

KNOWN = ["--xla_force_host_platform_device_count=3", "--xla_backend_optimization_level=0"]
UNKNOWN = "--xla_eqxpar_no_such_flag=true"


def test_unknown_flags_are_dropped_and_the_kept_ones_start_jax(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # probe for real, not from a cache
    kept = supported_xla_flags([KNOWN[0], UNKNOWN, KNOWN[1]])
    assert kept == KNOWN
    # The answer is cached per interpreter, jaxlib and flag list, so the next test
    # session does not start a backend again.
    (cache,) = tmp_path.glob("eqxpar/xla_flags.json")
    assert KNOWN in json.loads(cache.read_text()).values()
    assert supported_xla_flags([KNOWN[0], UNKNOWN, KNOWN[1]]) == KNOWN

    # The proof that matters: a process given the kept flags starts and they act
    # (3 devices); given the unknown one, XLA kills it.
    code = "import jax; print(len(jax.devices()))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ok = subprocess.run(
        [sys.executable, "-c", code], env={**env, "XLA_FLAGS": " ".join(kept)}, capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "3", ok.stderr[-2000:]
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**env, "XLA_FLAGS": UNKNOWN}, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "no_such_flag" in bad.stderr
