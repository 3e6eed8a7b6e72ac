"""Typed train-step builders: `TrainState`, `init`, `make_step`, `make_value_and_grad`;
`make_eval_step` and `evaluate` for held-out losses under any plan;
`Throughput`, a training loop's tokens per second
and MFU; and `SkipMonitor` for steps skipped as non-finite."""

from ._eval import EvalStep as EvalStep
from ._eval import evaluate as evaluate
from ._eval import make_eval_step as make_eval_step
from ._nonfinite import SkipMonitor as SkipMonitor
from ._step import Step as Step
from ._step import make_step as make_step
from ._step import make_value_and_grad as make_value_and_grad
from ._throughput import Throughput as Throughput
from ._train_state import TrainState as TrainState
from ._train_state import init as init
