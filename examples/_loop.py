"""The training loop the examples share: steps with a progress bar, and a line of
train loss, eval loss and learning rate every so often."""

from collections.abc import Callable
from typing import Any


def train(
    step: Callable,
    state: Any,
    next_batch: Callable[[], Any],
    evaluate: Callable[[Any], Any],
    *,
    steps: int,
    every: int,
) -> Any:
    """Run `steps` steps of `step(state, next_batch())`; every `every` steps (and at
    the end) report the loss, `evaluate(model)` and the learning rate. Returns the state."""
    try:
        from tqdm import trange
    except ImportError:  # the examples extra is optional
        trange = range
    bar = trange(steps)
    for i in bar:
        state, metrics = step(state, next_batch())
        if (i + 1) % every == 0 or i + 1 == steps:
            message = (
                f"step {i + 1}: loss {float(metrics['loss']):.3f}, "
                f"eval {float(evaluate(state.model)):.3f}, lr {float(metrics['learning_rate']):.2e}"
            )
            bar.write(message) if hasattr(bar, "write") else print(message)
    return state
