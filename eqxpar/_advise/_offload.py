"""The advisor's host-offload terms (`Plan(offload=...)`), read off the TPU
compiler's programs for Llama-3-8B under FSDP 32 (BENCHMARKS.md, "Host offload on
the TPU compiler").

- **Host arguments.** What the plan offloads lives in host memory between steps
  and the new state is written over it: the parameters' and the optimizer
  state's bytes per device, exactly.
- **Optimizer state.** Off XLA:CPU the update streams it through the device a
  layer at a time (`eqxpar/_train/_streamed_update.py`): one chunk of the
  moments is counted (on 8B the compiled temporaries even fell by 0.09 GiB: the
  plain update's own temporaries shrink to a chunk's too, and the next chunk's
  fetch overlaps them).
  Where nothing streams (XLA:CPU, a model without stacked layers, ZeRO-1) the
  whole state comes onto the device for the update.
- **Parameters.** They come onto the device whole at the top of the step and
  may stay there for the forward and backward pass: their bytes leave the
  arguments and are counted back as temporaries (libtpu 0.0.52's program on 8B:
  1.02 GiB more temporaries for 0.93 GiB offloaded; 0.0.50.1's keeps 0.45, an
  upper bound then).
"""

import dataclasses
from typing import Any

from .._train._step_layout import StepLayout
from .._train._streamed_update import chunk_count


@dataclasses.dataclass(frozen=True)
class OffloadTerms:
    """Per device: `host_arguments`, the state bytes kept in host memory;
    `device_temporaries`, what bringing them onto the device adds to the
    device's temporaries."""

    host_arguments: int
    device_temporaries: int


def offload_terms(
    layout: StepLayout, model: Any, params_bytes: int, opt_bytes: int, platform: str
) -> OffloadTerms:
    """The offload terms of a step over `model` (an outline) laid out by `layout`
    on a `platform` (`DeviceProfile.platform`), with `params_bytes` and
    `opt_bytes` of state per device."""
    host = device = 0
    if layout.memory_kind("params"):
        host += params_bytes
        device += params_bytes
    if layout.memory_kind("optimizer"):
        streams = platform != "cpu" and not layout.sliced_update
        chunks = chunk_count(model, layout.updates) if streams else 1
        host += opt_bytes
        device += opt_bytes // chunks
    return OffloadTerms(host_arguments=host, device_temporaries=device)
