"""Benchmarks: eqxpar strategies side by side with hand-written `jax.jit` steps on the ANCHORS.md workload."""
