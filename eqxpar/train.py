"""Typed train-step builders: `TrainState`, `init`, `make_step`."""

from ._step import Step as Step, make_step as make_step
from ._train_state import TrainState as TrainState, init as init
