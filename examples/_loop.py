"""The training loop the examples share: steps with a progress bar, and a line of
train loss, eval loss and learning rate every so often."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

import eqxpar


def adamw_warmup_cosine(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW (weight decay 0.01) with 5% linear warm-up then cosine decay over
    `steps`, its learning rate exposed for the metrics."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), max(2, steps))
    return optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)


def print_collectives(step: Any, state: Any, batch: Any) -> None:
    """Print what one step communicates, read from its compiled HLO (per device)."""
    stats = eqxpar.inspect.collective_stats(step.compile(state, batch))
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(stats.count.items()))
    print(f"collectives per step: {kinds or 'none'}; {stats.total_wire_bytes / 1e6:.2f} MB sent per device")


def train(
    step: Callable,
    state: Any,
    next_batch: Callable[[], Any],
    eval_step: eqxpar.train.EvalStep,
    eval_batches: Sequence[Any],
    *,
    steps: int,
    every: int,
    on_eval: Callable[[int, float], None] | None = None,
) -> Any:
    """Run `steps` steps of `step(state, next_batch())`; every `every` steps (and at
    the end) report the loss, the held-out loss over `eval_batches`
    (`eqxpar.train.evaluate` with `eval_step`: the plan's own sharding, every row
    counted) and the learning rate, and call `on_eval(steps done, eval loss)`.
    Returns the state."""
    try:
        from tqdm import trange
    except ImportError:  # the examples extra is optional
        trange = range
    bar = trange(steps)
    for i in bar:
        state, metrics = step(state, next_batch())
        # One step in flight at a time: XLA:CPU's collectives can give up waiting
        # ("rendezvous ... may be stuck") when many dispatched steps queue up.
        jax.block_until_ready(metrics["loss"])
        if (i + 1) % every == 0 or i + 1 == steps:
            held_out = float(eqxpar.train.evaluate(eval_step, state, eval_batches)["loss"])
            if on_eval is not None:
                on_eval(i + 1, held_out)
            message = (
                f"step {i + 1}: loss {float(metrics['loss']):.3f}, "
                f"eval {held_out:.3f}, lr {float(metrics['learning_rate']):.2e}"
            )
            bar.write(message) if hasattr(bar, "write") else print(message)
    return state
