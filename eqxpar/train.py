"""Typed train-step builders: `TrainState`, `init`, `make_step`, `make_value_and_grad`."""

from ._step import Step as Step, make_step as make_step, make_value_and_grad as make_value_and_grad
from ._train_state import TrainState as TrainState, init as init
