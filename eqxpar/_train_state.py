"""The train state and its sharded initialisation."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._plan import Plan
from ._sharding import shard
from ._specs import partition_specs


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """`tree` with every floating-point array cast to `dtype` (others unchanged)."""

    def cast(x: Any) -> Any:
        if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


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
    gets the sharding of the parameter it mirrors (under `Plan(zero1=True)`, that
    plus a split over the batch axes), scalar counters are replicated. With
    `Plan(param_dtype=...)` floating-point weights are cast to it first.

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
            if plan.param_dtype is not None:
                model = cast_floating(model, plan.param_dtype)
            model = shard(model, plan)
            opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
            opt_specs = partition_specs(opt_state, plan.optimizer_rules, mesh=plan.mesh)
            return model, shard(opt_state, plan, specs=opt_specs)

    model, opt_state = place(model)
    replicated = plan.sharding(PartitionSpec())
    # Built from host values: a key made by jax.random.key lives on one local
    # device, which device_put cannot place on a mesh spanning several processes.
    step = jax.device_put(np.zeros((), np.int32), replicated)
    if not isinstance(key, jax.core.Tracer):  # traced (eval_shape, jit): nothing to place
        key_data = jax.device_put(np.asarray(jax.random.key_data(key)), replicated)
        key = jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(key))
    return TrainState(model=model, opt_state=opt_state, step=step, key=key)
