"""The XLA flags every process of the suite compiles with: pytest's workers
(tests/conftest.py), the plan fuzz's workers, and the examples, docs blocks and
multi-process runs the tests start as subprocesses.

The suite compiles hundreds of small programs and runs each a few times, so
compiling is most of its time, and generating machine code most of compiling.
`CHEAP_CODEGEN` cuts that (no LLVM optimisation, XLA:CPU's elemental emitter for
fused elementwise ops instead of its MLIR fusion emitters): a tiny pipeline
example compiles in half the time. The HLO passes that partition the program and
place and schedule its collectives run either way, so every collective and byte
count the tests read is the same, and results are compared with one device
compiled alike.

This module imports nothing heavy: the fuzz worker imports it before JAX.
"""

from eqxpar.runtime import supported_xla_flags

DEVICES_8 = "--xla_force_host_platform_device_count=8"
# XLA:CPU running each device's collectives in program order: plans manual over
# several axes need it (see eqxpar.train.make_step).
IN_ORDER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
CHEAP_CODEGEN = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def suite_xla_flags(*flags: str) -> str:
    """`flags` and `CHEAP_CODEGEN`, as one XLA_FLAGS value, keeping only the flags
    this jaxlib knows: releases drop flags (the fusion-emitter switch is gone from
    jaxlib 0.12) and XLA aborts the process on one it does not know."""
    return " ".join(supported_xla_flags([*flags, *CHEAP_CODEGEN]))
