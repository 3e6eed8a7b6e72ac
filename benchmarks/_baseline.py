"""Hand-written training steps eqxpar is measured against, with `jax.jit`,
`jax.value_and_grad` and optax only: `JitStep` with explicit shardings on a mesh
(the bar for speed and bytes) and `reference_run` on one device (the bar for numbers)."""

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


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def shardings(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


class OwnStateStep:
    """`step: (params, opt_state, batch) -> (params, opt_state, loss)` jitted on `mesh`,
    holding its own (donated) copy of `params` and their optimizer state."""

    def __init__(self, step, optim, params, mesh: Mesh, specs, opt_specs, batch_spec, **jit_options):
        # Copy inside jit: fresh buffers owned by this step, created in their sharding.
        @jax.jit
        def place(params):
            params = jax.lax.with_sharding_constraint(jax.tree.map(jnp.copy, params), shardings(mesh, specs))
            return params, jax.lax.with_sharding_constraint(optim.init(params), shardings(mesh, opt_specs))

        self.params, self.opt_state = place(params)
        self.batch_sharding = NamedSharding(mesh, batch_spec)
        self.jitted = jax.jit(step, donate_argnums=(0, 1), **jit_options)

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
        opt_state_specs = param_specs if opt_state_specs is None else opt_state_specs
        state = (shardings(mesh, param_specs), shardings(mesh, opt_state_specs))
        super().__init__(
            _train_step(loss_fn, optim, static),
            *(optim, params, mesh, param_specs, opt_state_specs, batch_spec),
            in_shardings=(*state, NamedSharding(mesh, batch_spec)),
            out_shardings=(*state, NamedSharding(mesh, PartitionSpec())),
        )


def opt_specs(optim: optax.GradientTransformation, model: Any, param_specs: Any) -> Any:
    """Optimizer-state specs mirroring `param_specs` (moments shaped like the parameters)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    params_def = jax.tree.structure(params)
    spec_leaves = jax.tree.leaves(param_specs, is_leaf=is_spec)

    def for_node(node: Any) -> Any:
        if jax.tree.structure(node) == params_def:
            return jax.tree.unflatten(params_def, spec_leaves)
        return jax.tree.map(lambda _: PartitionSpec(), node)

    state = jax.eval_shape(optim.init, params)
    return jax.tree.map(for_node, state, is_leaf=lambda n: jax.tree.structure(n) == params_def)


def reference_run(
    loss_fn: Callable, optim: Any, model: PyTree, batches: Sequence
) -> tuple[PyTree, jax.Array]:
    """(parameters, last loss) after one step per batch on one device, no mesh: the
    numbers every strategy must reproduce (same float32 math, init and batches)."""
    device = jax.devices()[0]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = jax.device_put(jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params), device)
    opt_state = optim.init(params)
    step = jax.jit(_train_step(loss_fn, optim, static), donate_argnums=(0, 1))
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
    return params, loss
