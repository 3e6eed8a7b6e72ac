"""The advisor's host-offload terms (`Plan(offload=...)`), read off the TPU
compiler's programs for Llama-3-8B under FSDP 32 (BENCHMARKS.md, "Host offload on
the TPU compiler").

- **Host arguments.** What the plan offloads lives in host memory between steps
  and the new state is written over it: the parameters' and the optimizer
  state's bytes per device, exactly.
- **Optimizer state.** Off XLA:CPU the update streams it through the device a
  layer at a time (`eqxpar/_train/_streamed_update.py`): one chunk of the
  moments is counted (8B: the compiled temporaries rose by 0.09 GiB, 70B fell by
  0.12: the plain update's own temporaries shrink to a chunk's too, and the
  next chunk's fetch overlaps them).
  Where nothing streams (XLA:CPU, a model without stacked layers, ZeRO-1) the
  whole state comes onto the device for the update.
- **Parameters.** Off XLA:CPU and outside pipelines the step brings those
  outside a scanned stack onto the device whole and leaves the stack's weights in
  host memory; the scan moves each layer's slice over and each layer's gradient
  back, so the stacked gradients wait in host memory through the backward pass
  (counted off the device's temporaries) and the compiler keeps about three
  stacks' bytes of host temporaries (8B: 2.44 GiB for 0.81 of stacked weights per
  chip; the same ratio on a toy stack at 4, 8 and 16 layers). On 8B the term
  says 0.69 GiB fewer temporaries where libtpu 0.0.50.1 reports 0.82 fewer; its
  buffer assignment (`AotReport.heap_temp_bytes`) falls by 0.11 only (both peaks
  in the head's phase: the stack's bfloat16 casts gone, the backward's first
  layer, peeled out of its loop, beside the head), the rest being that libtpu's
  excess over its buffers, which the term follows. Elsewhere they come
  onto the device whole at the top of the step and are counted back as
  temporaries (libtpu 0.0.52's program: 1.02 GiB for 0.93 offloaded).
- **Activations.** The values a `RematPolicy` names as offloaded are kept in
  host memory instead of the device's: each named value's bytes (once per layer
  of a scanned stack), split as the batch is (and over the tensor axis, but for
  a block's input), leave the device's residuals for the host's temporaries:
  the stacked buffers the forward scan writes them into are host buffers (8B:
  `bf16[32,1,2048,32,128]` for the queries, two `bf16[32,1,2048,8,128]` for the
  keys and values, 0.75 GiB of host temporaries). One layer's values stay on
  the device as the transfers' buffers: the forward computes each layer's
  projections on the device before copying them out, and the backward copies
  each layer's back (`dynamic-slice`s of the host buffers, 16 + 4 + 4 MiB on
  8B, live beside the head's phase as the last layer's prefetch). Against the
  same names saved on the device, the compiled heap (the preallocated temp
  buffer) fell by 0.733 GiB for 0.75 offloaded. XLA:CPU ignores activation
  offload.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec

from .._sizes import itemsize
from .._specs import is_array_like
from .._stack_order import OrderedStack
from .._train._step_layout import StepLayout
from .._train._streamed_update import chunk_count
from ._shard_bytes import per_device_bytes


def offload_terms(
    layout: StepLayout,
    model: Any,
    params_bytes: int,
    opt_bytes: int,
    platform: str,
    *,
    loss: Callable,
    batch: Any,
) -> dict[str, int]:
    """The offload terms of a step over `model` (an outline) laid out by `layout`
    on a `platform` (`DeviceProfile.platform`), with `params_bytes` and
    `opt_bytes` of state per device; `loss` and the global `batch` (an outline)
    give the named activations. Per device, as `Prediction`'s fields:
    `host_argument_bytes` (the state kept in host memory), `offload_bytes` (what
    bringing it onto the device adds to the device's temporaries, less the
    activations kept on the host) and `host_temp_bytes` (those activations, and the
    compiler's host copies of offloaded stacked parameters' gradients)."""
    host = device = host_temp = 0
    dims = layout.resolved.dims
    if "activations" in dims.offload and platform != "cpu":
        host_temp, one_layer = policy_activations(layout, model, loss, batch, dims.remat.offloaded)
        # Off the device but for one layer's transfer buffers (see the module).
        device -= host_temp - one_layer
    if layout.memory_kind("params"):
        host += params_bytes
        if layout.streams_stacked_params_on(platform):
            stacked_bytes = _stacked_bytes(model, layout.params, layout.plan.mesh)
            # The weights outside the stacks come whole; the stacked gradients
            # wait in host memory, beside the compiler's copies.
            device += params_bytes - 2 * stacked_bytes
            host_temp += 3 * stacked_bytes
        else:
            device += params_bytes
    if layout.memory_kind("optimizer"):
        streams = platform != "cpu" and not layout.sliced_update
        chunks = chunk_count(model, layout.updates) if streams else 1
        host += opt_bytes
        device += opt_bytes // chunks
    return {"host_argument_bytes": host, "offload_bytes": device, "host_temp_bytes": host_temp}


def _stacked_bytes(params: Any, specs: Any, mesh: Any) -> int:
    """Per device, the bytes of the parameters inside scanned stacks (`eqxpar.nn.Stacked`)."""

    def stacks(tree: Any) -> list:
        nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (OrderedStack, PartitionSpec)))
        return [n for n in nodes if isinstance(n, OrderedStack)]

    return sum(
        per_device_bytes(stack, stack_specs, mesh)
        for stack, stack_specs in zip(stacks(params), stacks(specs), strict=True)
    )


def policy_activations(
    layout: StepLayout, model: Any, loss: Callable, batch: Any, names: tuple[str, ...]
) -> tuple[int, int]:
    """Per device, the bytes of the activations a `RematPolicy` keeps under
    `names` (its saved or its offloaded ones): the values the layers name
    (`checkpoint_name`), each once per trip of the scans around it, traced on
    outlines under the plan (float32 weights: each value in the plan's compute
    dtype); and of one trip's (one layer's) values."""
    dims = layout.resolved.dims
    if not names:
        return 0, 0
    floating = lambda x: is_array_like(x) and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)  # noqa: E731
    params, static = eqx.partition(model, floating)
    with layout.plan:
        closed = jax.make_jaxpr(lambda p, b: loss(eqx.combine(p, static), b))(params, batch)
    split = dims.batch_size_multiple * dims.context_size
    found: dict[str, list[int]] = {}
    # Traced in the weights' dtype; the step computes (and names) them in the
    # plan's compute dtype.
    _named_bytes(closed.jaxpr, frozenset(names), 1, found, dims.compute_dtype)
    # A block's input is whole over the tensor axis; the projections split there.
    tensor = {name: 1 if name == "decoder_layer_input" else dims.tensor_size for name in found}
    total = sum(n // split // tensor[name] for name, (n, _) in found.items())
    one = sum(n // split // tensor[name] for name, (_, n) in found.items())
    return total, one


def _named_bytes(
    jaxpr: Any, names: frozenset[str], trips: int, found: dict[str, list[int]], compute_dtype: Any
) -> None:
    """Add to `found[name]` the global bytes of each value `jaxpr` names in
    `names` (a floating one in `compute_dtype` where that is not None): times
    the trips of the scans it runs in, and once."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and eqn.params.get("name") in names:
            name, aval = eqn.params["name"], eqn.outvars[0].aval
            floating = jax.numpy.issubdtype(aval.dtype, jax.numpy.floating)
            dtype = aval.dtype if compute_dtype is None or not floating else compute_dtype
            size = aval.size * itemsize(dtype)
            total, once = found.get(name, [0, 0])
            found[name] = [total + trips * size, once + size]
        inner_trips = trips * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else trips
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                _named_bytes(inner, names, inner_trips, found, compute_dtype)
