"""Benchmarks: eqxpar strategies beside hand-written `jax.jit` steps on one workload (README.md)."""

import os

# 8 simulated CPU devices: XLA reads the flags once, when jax is first imported, so
# they are set before any benchmark module imports it (unless a test set them). The
# scheduler flag keeps XLA:CPU from running two collectives of a multi-axis manual
# plan at once (which can abort the process; eqxpar warns without it).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
