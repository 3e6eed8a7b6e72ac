"""Hand-written training steps eqxpar is measured against, with `jax.jit`,
`jax.value_and_grad` and optax only: `JitStep` with explicit shardings on a mesh (the
bar for speed and bytes; on a one-device mesh, the bar for numbers)."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree


def train_step(loss_fn: Callable, optim: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, batch) -> (params, opt_state, loss)`: one optax step on
    `loss_fn(params, batch)`."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def shardings(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


class OwnStateStep:
    """`step: (params, opt_state, batch) -> (params, opt_state, loss)` jitted on `mesh` with
    the shardings of `specs`, `opt_specs` and `batch_spec`, holding its own (donated) copy
    of `params` and their optimizer state."""

    def __init__(self, step, optim, params, mesh: Mesh, specs, opt_specs, batch_spec):
        state = (shardings(mesh, specs), shardings(mesh, opt_specs))
        self.batch_sharding = NamedSharding(mesh, batch_spec)
        # Copy inside jit: fresh buffers owned by this step, created in their sharding.
        place = jax.jit(lambda p: (jax.tree.map(jnp.copy, p), optim.init(p)), out_shardings=state)
        self.params, self.opt_state = place(params)
        loss = NamedSharding(mesh, PartitionSpec())
        in_out = {"in_shardings": (*state, self.batch_sharding), "out_shardings": (*state, loss)}
        self.jitted = jax.jit(step, donate_argnums=(0, 1), **in_out)

    def put_batch(self, batch: PyTree) -> PyTree:
        return jax.device_put(batch, self.batch_sharding)

    def __call__(self, batch: PyTree) -> jax.Array:
        """One step on an already placed batch; returns the loss."""
        self.params, self.opt_state, loss = self.jitted(self.params, self.opt_state, batch)
        return loss

    def compile(self, batch: PyTree) -> jax.stages.Compiled:
        return self.jitted.lower(self.params, self.opt_state, batch).compile()


class JitStep(OwnStateStep):
    """A `jax.jit` train step of `loss_fn` on `model` (copied, never donated), parameters
    laid out by `param_specs` (one spec, or a pytree), the optimizer state by
    `opt_state_specs` (default: `param_specs`) and every batch leaf by `batch_spec`."""

    def __init__(self, loss_fn, optim, model, mesh, *, param_specs, batch_spec, opt_state_specs=None):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        step = train_step(lambda p, batch: loss_fn(eqx.combine(p, static), batch), optim)
        opt_state_specs = param_specs if opt_state_specs is None else opt_state_specs
        super().__init__(step, optim, params, mesh, param_specs, opt_state_specs, batch_spec)


def opt_specs(optim: optax.GradientTransformation, model: Any, param_specs: Any) -> Any:
    """Optimizer-state specs mirroring `param_specs` (moments shaped like the parameters)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    params_def = jax.tree.structure(params)
    specs = jax.tree.unflatten(params_def, jax.tree.leaves(param_specs, is_leaf=is_spec))
    is_params = lambda node: jax.tree.structure(node) == params_def  # noqa: E731
    for_node = lambda node: specs if is_params(node) else PartitionSpec()  # noqa: E731
    return jax.tree.map(for_node, jax.eval_shape(optim.init, params), is_leaf=is_params)
