"""XLA flags chosen by what the installed jaxlib knows.

XLA reads `XLA_FLAGS` once, when JAX starts its first backend, and aborts the whole
process on a flag it does not know (`Unknown flag in XLA_FLAGS: ...`): a fatal log,
not a Python exception, so no `try` can catch it. Flags come and go between jaxlib
releases (`--xla_cpu_use_fusion_emitters` is gone from 0.12), so a flag list written
for one release kills every process of another. The only reliable test of a flag is
to start a backend with it, in a child process; the answer is cached on disk per
jaxlib version, since it cannot change without a reinstall.

This module imports nothing from JAX (importing `eqxpar` imports JAX but starts no
backend), so a test set-up or a launcher can use it before JAX starts.
"""

import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

from .._errors import EqxparError

# "Unknown flag in XLA_FLAGS: --a=1" (one) or "Unknown flags in XLA_FLAGS: --a=1 --b" (several).
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_PROBE = "import jax; jax.devices('cpu')"


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def _cache_file() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "eqxpar" / "xla_flags.json"


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _probe(flags: list[str]) -> tuple[bool, set[str]]:
    """Start a CPU backend with `flags`: (it started, the flag names XLA called unknown)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode == 0:
        return True, set()
    unknown = set()
    for match in _UNKNOWN.finditer(result.stderr):
        unknown |= {_flag_name(f) for f in match.group(1).split()}
    return False, unknown


def _check(flags: list[str]) -> list[str]:
    kept = list(flags)
    # Each round drops every flag XLA named; a release names them all at once, but a
    # second round costs little and covers one that reports them one at a time.
    for _ in range(len(flags) + 1):
        started, unknown = _probe(kept)
        if started:
            return kept
        if not unknown:
            raise EqxparError(
                f"JAX's CPU backend did not start with XLA_FLAGS={' '.join(kept)!r}, and XLA named "
                "no unknown flag; run `python -c \"import jax; jax.devices('cpu')\"` with those "
                "flags to see why."
            )
        kept = [f for f in kept if _flag_name(f) not in unknown]
    return kept


def supported_xla_flags(flags: Sequence[str]) -> list[str]:
    """The flags of `flags` that this interpreter's jaxlib knows, in their order.

    Each flag is tried by starting JAX's CPU backend in a child process (about two
    seconds, once per jaxlib version: the answer is cached under
    `~/.cache/eqxpar/`). Nothing here imports JAX, so this can run before JAX starts,
    which is when `XLA_FLAGS` must be set.

    **Arguments:**

    - `flags`: XLA flags, e.g. `["--xla_force_host_platform_device_count=8"]`.

    **Returns:** the known flags. An unknown one is left out, never passed on to abort
    the process.

    ```python
    import os
    from eqxpar.runtime import supported_xla_flags

    flags = supported_xla_flags(["--xla_force_host_platform_device_count=8",
                                 "--xla_cpu_use_fusion_emitters=false"])  # gone in jaxlib 0.12
    os.environ["XLA_FLAGS"] = " ".join(flags)
    ```
    """
    flags = [f for flag in flags for f in shlex.split(flag)]
    # This interpreter's jaxlib answers, so its path and jaxlib version key the cache.
    key = hashlib.sha256(json.dumps([sys.executable, _jaxlib_version(), flags]).encode()).hexdigest()[:16]
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), list):
        return list(cached[key])
    kept = _check(flags)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: two test workers may probe at once.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: kept}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: probe again next time
    return kept
