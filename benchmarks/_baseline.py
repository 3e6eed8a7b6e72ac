"""Hand-written training steps that eqxpar is measured against.

Written directly with `jax.jit`, `jax.value_and_grad` and optax, without eqxpar, so
that they show what a user gets with no library: `JitStep` with explicit in/out
shardings on a mesh (the bar for speed and bytes), and `reference_run` on one device
with no mesh at all (the bar for numbers).
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree


def _train_step(loss_fn: Callable, optim: optax.GradientTransformation, static: PyTree) -> Callable:
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), batch))(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class OwnStateStep:
    """A compiled `(params, opt_state, batch) -> (params, opt_state, loss)` step that
    holds its own (donated) state: subclasses set `jitted`, `params`, `opt_state`
    and `batch_sharding`."""

    jitted: Any
    params: PyTree
    opt_state: PyTree
    batch_sharding: NamedSharding

    def put_batch(self, batch: PyTree) -> PyTree:
        return jax.device_put(batch, self.batch_sharding)

    def __call__(self, batch: PyTree) -> jax.Array:
        """One step on an already placed batch; returns the loss."""
        self.params, self.opt_state, loss = self.jitted(self.params, self.opt_state, batch)
        return loss

    def compile(self, batch: PyTree) -> jax.stages.Compiled:
        return self.jitted.lower(self.params, self.opt_state, batch).compile()


class JitStep(OwnStateStep):
    """A `jax.jit` train step with the given shardings; holds its own (donated) state.

    **Arguments:**

    - `loss_fn`, `optim`, `model`: the workload; the model's arrays are copied, never donated.
    - `mesh`: the mesh the shardings live on.
    - `param_specs`: PartitionSpecs of the parameters: one for all, or a pytree of them.
    - `opt_state_specs`: PartitionSpecs of the optimizer state; defaults to `param_specs`
      when that is a single spec (e.g. everything replicated), else required.
    - `batch_spec`: the PartitionSpec of every batch leaf.
    """

    def __init__(
        self,
        loss_fn: Callable,
        optim: optax.GradientTransformation,
        model: PyTree,
        mesh: Mesh,
        *,
        param_specs: Any,
        batch_spec: PartitionSpec,
        opt_state_specs: Any = None,
    ):
        if opt_state_specs is None:
            if not isinstance(param_specs, PartitionSpec):
                raise ValueError("JitStep: give opt_state_specs when the parameters have per-leaf specs")
            opt_state_specs = param_specs
        params, static = eqx.partition(model, eqx.is_inexact_array)
        to_shardings = lambda specs: jax.tree.map(  # noqa: E731
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
        )
        param_shardings = to_shardings(param_specs)
        opt_shardings = to_shardings(opt_state_specs)
        self.batch_sharding = NamedSharding(mesh, batch_spec)
        replicated = NamedSharding(mesh, PartitionSpec())

        # Copy inside jit: fresh buffers owned by this step, created in their sharding.
        @jax.jit
        def place(params):
            params = jax.lax.with_sharding_constraint(jax.tree.map(jnp.copy, params), param_shardings)
            return params, jax.lax.with_sharding_constraint(optim.init(params), opt_shardings)

        self.params, self.opt_state = place(params)
        self.jitted = jax.jit(
            _train_step(loss_fn, optim, static),
            in_shardings=(param_shardings, opt_shardings, self.batch_sharding),
            out_shardings=(param_shardings, opt_shardings, replicated),
            donate_argnums=(0, 1),
        )


def reference_run(
    loss_fn: Callable, optim: optax.GradientTransformation, model: PyTree, batches: Sequence[PyTree]
) -> tuple[PyTree, jax.Array]:
    """Train on one device, no mesh, one step per batch; return (parameters, last loss).

    The numbers every strategy must reproduce: same float32 math, same init, same batches.
    """
    device = jax.devices()[0]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = jax.device_put(jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params), device)
    opt_state = optim.init(params)
    step = jax.jit(_train_step(loss_fn, optim, static), donate_argnums=(0, 1))
    loss = None
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
    return params, loss
