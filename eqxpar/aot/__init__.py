"""Compile ahead of time: a model's train step compiled from shapes for a TPU
topology this machine does not have (or for its own devices), with what the
compiler says of it before a chip is rented.

- `compile_train_step(model, plan, batch=(rows, length))`: an `AotReport`: memory
  per chip against the chip's, collectives per mesh axis against the plan's
  minimum, the share of them scheduled asynchronously, compile time.
- `python -m eqxpar.aot --model llama3-8b --topology v5p-64 --plan fsdp=32
  --batch 1x2048` prints it (exit status 1 when the plan does not fit).
"""

from ._command import main as main
from ._command import parse_axes as parse_axes
from ._command import parse_batch as parse_batch
from ._command import plan_of as plan_of
from ._compile import DEVICE_MEMORY as DEVICE_MEMORY
from ._compile import compile_train_step as compile_train_step
from ._report import AotReport as AotReport
