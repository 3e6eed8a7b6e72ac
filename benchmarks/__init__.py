"""Benchmarks: eqxpar strategies beside hand-written `jax.jit` steps on one workload (README.md)."""

import os

# 8 simulated CPU devices, set before jax is imported (unless a test set them); the scheduler
# flag keeps XLA:CPU from running two collectives of a manual plan at once (it can abort).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
