"""The train state and its sharded initialisation."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._plan import Plan
from ._sharding import shard


class TrainState(eqx.Module):
    """Everything a training run carries from step to step.

    - `model`: the Equinox model (arrays sharded per the plan's rules).
    - `opt_state`: the optax state, sharded like the parameters it mirrors.
    - `step`: the number of completed steps (int32 scalar).
    - `key`: a PRNG key; a loss function that takes `key=` receives
      `jax.random.fold_in(key, step)` each step, so runs are reproducible.
    """

    model: PyTree
    opt_state: PyTree
    step: Int[Array, ""]
    key: PRNGKeyArray


def init(
    model: PyTree, optimizer: optax.GradientTransformation, plan: Plan, *, key: PRNGKeyArray
) -> TrainState:
    """Place `model` on the plan's mesh and build its sharded optimizer state.

    The optimizer state is created directly in its final sharding (inside jit), so a
    state too large for one device never exists whole on one device; every moment
    gets the sharding of the parameter it mirrors, scalar counters are replicated.

    **Arguments:**

    - `model`: an Equinox model (any pytree; non-array leaves are kept).
    - `optimizer`: an optax gradient transformation.
    - `plan`: the plan giving mesh and rules.
    - `key`: a PRNG key stored in the state (keyword-only).

    **Returns:** a `TrainState` with `step == 0`.

    ```python
    state = eqxpar.train.init(model, optax.adamw(1e-3), plan, key=jax.random.key(0))
    ```
    """

    # Built inside jit so that the state owns fresh buffers (each step donates
    # them; they must not be the caller's model arrays) and is created directly in
    # its sharding.
    @eqx.filter_jit
    def place(model: Any) -> tuple[Any, Any]:
        with plan:
            model = shard(model, plan)
            return model, shard(optimizer.init(eqx.filter(model, eqx.is_array)), plan)

    model, opt_state = place(model)
    replicated = plan.sharding(PartitionSpec())
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    key = jax.device_put(key, replicated)
    return TrainState(model=model, opt_state=opt_state, step=step, key=key)
