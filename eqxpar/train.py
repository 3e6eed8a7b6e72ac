"""Typed train-step builders: `TrainState`, `init`, `make_step`, `make_value_and_grad`;
`make_eval_step` and `evaluate` for held-out losses under any plan; metric
trackers (`Tracker`, `JsonLinesTracker`, `TensorBoardTracker`, `Trackers`);
`Throughput`, a training loop's tokens per second
and MFU; `SkipMonitor` for steps skipped as non-finite; and `WeightedMean`, a
loss kept as a weighted sum and its weight (packed or masked tokens)."""

from ._throughput import Throughput as Throughput
from ._tracking import JsonLinesTracker as JsonLinesTracker
from ._tracking import TensorBoardTracker as TensorBoardTracker
from ._tracking import Tracker as Tracker
from ._tracking import Trackers as Trackers
from ._weighted import WeightedMean as WeightedMean
from ._train._eval import EvalStep as EvalStep
from ._train._eval import evaluate as evaluate
from ._train._eval import make_eval_step as make_eval_step
from ._train._nonfinite import SkipMonitor as SkipMonitor
from ._train._step import Step as Step
from ._train._step import ValueAndGrad as ValueAndGrad
from ._train._step import make_step as make_step
from ._train._step import make_value_and_grad as make_value_and_grad
from ._train._train_state import TrainState as TrainState
from ._train._train_state import init as init
