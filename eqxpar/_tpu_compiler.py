"""The options eqxpar hands the TPU compiler, shared by `eqxpar.aot` and
`Advice.check` and a step run on attached chips (the step's `jax.jit` holds
them on a TPU mesh) and the advisor (which predicts the program they give).

libtpu reduces each FSDP weight's gradient as a windowed einsum: a ring that
passes `g + 1` shards of the gradient round the `g` devices of the FSDP group in
both directions, overlapping them with the matmul that makes it, where a
reduce-scatter moves `g - 1`. Two shards more is 2/31 of a scatter's bytes over
32 devices but 2/7 over 8. Compiled for v5p with JAX 0.12.0 and libtpu 0.0.50.1
(`benchmarks.tpu_compile`), with the reduce-scatters' rings off:

- Llama-3-8B, FSDP 8 x tensor 4: wire 1.062x -> 1.046x `minimum_comm`,
  temporaries 2.96 -> 2.59 GiB per chip, the share of wire overlapped with
  compute 26 % -> 16 %;
- Llama-3-8B, FSDP 32: the gradients are all-reduced instead (wire 1.05x -> 1.27x);
- Llama-3-70B, FSDP 32 x tensor 4: wire 1.022x -> 1.026x, temporaries up 86 MB.

So eqxpar turns them off only where the plan splits weights over `tensor` and
over an FSDP group of at most 8 devices. `make_step` puts them in the step's
`jax.jit` on a TPU mesh, so `eqxpar.aot`'s compile and a step run on attached
chips are one program.
"""

from typing import Any

#: libtpu's switch for the gradient reduce-scatters' windowed einsums.
WINDOWED_SCATTERS = "xla_tpu_enable_windowed_einsum_for_reduce_scatter"
#: The largest FSDP group whose gradient reduce-scatters eqxpar has run plainly.
PLAIN_SCATTER_GROUP = 8


def plain_gradient_scatters(dims: Any, mesh: Any) -> bool:
    """Whether eqxpar has the TPU compiler reduce-scatter the FSDP gradients of a
    step under `dims` (`ParallelDims`) on `mesh` plainly rather than as windowed
    einsums (see the module): an automatic, unpipelined step with its weights split
    over `tensor` and over an `fsdp` group of 2 to `PLAIN_SCATTER_GROUP` devices,
    no expert axis."""
    fsdp = int(mesh.shape.get("fsdp", 1))
    return (
        dims.mode != "manual"
        and not dims.pipelined
        and dims.expert_size == 1
        and dims.tensor_size > 1
        and 1 < fsdp <= PLAIN_SCATTER_GROUP
    )


def tpu_compiler_options(dims: Any, mesh: Any) -> dict[str, str]:
    """The compiler options (`jax.jit(..., compiler_options=...)`) eqxpar
    compiles a step under `dims` for TPU with: `{}`, or the windowed scatters off
    where `plain_gradient_scatters`."""
    return {WINDOWED_SCATTERS: "false"} if plain_gradient_scatters(dims, mesh) else {}
