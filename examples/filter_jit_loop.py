"""Your own Equinox training loop, data-parallel, with no eqxpar train builder.

The loop is the one the Equinox documentation writes (`eqx.filter_jit`,
`eqx.filter_value_and_grad`, `optim.update`, `eqx.apply_updates`). The only
eqxpar lines place the model and each batch on the mesh: the compiler then runs
the step data-parallel (each device its share of the batch, one all-reduce of the
gradients) and the result equals one device's.

    python examples/filter_jit_loop.py
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqxpar  # noqa: E402


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(optim):
    """The step from Equinox's documentation, unchanged."""

    @eqx.filter_jit(donate="all-except-first")
    def step(x, y, model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return step


def batches(n, *, batch=64, seed=0):
    """A noisy sine regression problem: y = sin(3 x) + noise."""
    for k in jax.random.split(jax.random.key(seed), n):
        kx, kn = jax.random.split(k)
        x = jax.random.uniform(kx, (batch, 1), minval=-2, maxval=2)
        yield x, jnp.sin(3 * x) + 0.05 * jax.random.normal(kn, (batch, 1))


def train(model, optim, data, plan=None):
    """Train over `data`; with a plan, the model and each batch are placed on its mesh."""
    if plan is not None:
        model = eqxpar.shard(model, plan)  # replicated under the default (no) rules
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    step = make_step(optim)
    losses = []
    for x, y in data:
        if plan is not None:
            x, y = eqxpar.shard_batch((x, y), plan)  # split the batch over "data"
        model, opt_state, loss = step(x, y, model, opt_state)
        losses.append(float(loss))
    return model, losses


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    model = eqx.nn.MLP(1, 1, 64, 2, activation=jax.nn.tanh, key=jax.random.key(1))
    model, losses = train(model, optax.adam(3e-3), batches(args.steps), plan)
    print(f"{args.steps} steps on {plan.mesh.devices.size} devices: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("weights sharding:", model.layers[0].weight.sharding.spec, "(replicated: data parallel)")
    return np.array(losses)


if __name__ == "__main__":
    main()
