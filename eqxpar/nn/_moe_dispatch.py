"""The token exchange of a dropless MoE layer under expert parallelism: each
device's routed rows to the devices of their experts, and the outputs back.

Both directions use one layout: the receiving buffer has a block of `block` rows
per source device (source `j`'s rows at `j * block`, the rest of its block empty),
room for the worst case (every routed row of a device going to one other). How
the rows get there depends on the backend:

- *ragged* (`jax.lax.ragged_all_to_all`, on TPU): each device sends only the rows
  it routed, so the wire carries the routed activations once;
- *padded* (`jax.lax.all_to_all`, every other backend: XLA:CPU implements no
  ragged all-to-all): each device sends a whole `block` to every device, the
  routed rows followed by padding: `devices` times the routed activations.

Which one runs is chosen here, from the platform of the plan being traced
(`ragged_exchange`), unless `MoEConfig(exchange=...)` says, and the two give the
same numbers.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._errors import PlanError
from .._mesh import EXPERT_AXIS, mesh_platform
from .._plan import current_plan
from .._varying import mark_varying, varying_axes

#: The platforms whose compilers implement `ragged-all-to-all` and where eqxpar
#: uses it (XLA:CPU does not; GPU is not checked yet, so it takes the padded path).
RAGGED_PLATFORMS = ("tpu",)
#: The platforms whose compilers refuse `ragged-all-to-all` (UNIMPLEMENTED at
#: compile time on XLA:CPU, JAX 0.10.2 to 0.12.1): `"ragged"` is refused there
#: when traced, naming the fix, rather than left to the compiler's error.
NO_RAGGED_PLATFORMS = ("cpu",)


def ragged_exchange(exchange: str) -> bool:
    """Whether an MoE exchange configured `exchange` (`MoEConfig.exchange`) uses
    `jax.lax.ragged_all_to_all`: `"ragged"`, or `"auto"` where the plan being
    traced (`with plan:`, or an eqxpar step's) lays its mesh over devices of a
    platform in `RAGGED_PLATFORMS` (outside a plan: padded). Raises `PlanError`
    for `"ragged"` on a platform in `NO_RAGGED_PLATFORMS`."""
    plan = current_plan()
    platform = None if plan is None else mesh_platform(plan.mesh)
    ragged = ragged_on(exchange, platform)
    if ragged and platform in NO_RAGGED_PLATFORMS:
        raise PlanError(
            f"MoEConfig(exchange={exchange!r}) under a plan on {platform} devices: XLA:{platform.upper()} "
            "cannot compile jax.lax.ragged_all_to_all. Use exchange='auto' (padded here, ragged on TPU) "
            "or 'padded'."
        )
    return ragged


def ragged_on(exchange: str, platform: str | None) -> bool:
    """Whether an exchange configured `exchange` is ragged on devices of
    `platform` (None: not known, padded under `"auto"`); the advisor asks this
    of a device profile's platform."""
    if exchange != "auto":
        return exchange == "ragged"
    return platform in RAGGED_PLATFORMS


def send_rows(
    rows: Float[Array, "n d"],
    counts: Int[Array, " devices"],
    starts: Int[Array, " devices"],
    arriving: Int[Array, " devices"],
    *,
    ragged: bool,
) -> Float[Array, "devices_n d"]:
    """Send each device its rows: `rows` sorted by destination (`counts[j]` rows
    for device `j` from `starts[j]`); returns the receiving buffer, source `j`'s
    `arriving[j]` rows at `j * n` (`n = rows.shape[0]`, every block's room)."""
    n, d = rows.shape
    ep = counts.shape[0]
    if ragged:
        me = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32)
        out = _blank((ep * n, d), rows)
        offsets = jnp.full((ep,), me * n, jnp.int32)
        return jax.lax.ragged_all_to_all(rows, out, starts, counts, offsets, arriving, axis_name=EXPERT_AXIS)
    send = jnp.zeros((ep * n, d), rows.dtype).at[_slots(counts, starts, n)].set(rows)
    return jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True)


def return_rows(
    y: Float[Array, "devices_n d"],
    counts: Int[Array, " devices"],
    starts: Int[Array, " devices"],
    arriving: Int[Array, " devices"],
    *,
    ragged: bool,
) -> Float[Array, "n d"]:
    """`send_rows` backwards: the outputs `y` (the receiving buffer's layout) go
    back to their sources; returns this device's rows in the order it sent them
    (`counts`, `starts` and `arriving` as `send_rows` took them)."""
    ep = counts.shape[0]
    n, d = y.shape[0] // ep, y.shape[1]
    if ragged:
        # Where each source keeps the rows it sent here: its own `starts[me]`.
        at_source = jax.lax.all_to_all(starts[:, None], EXPERT_AXIS, 0, 0, tiled=True)[:, 0]
        blocks = jnp.arange(ep, dtype=jnp.int32) * n
        out = _blank((n, d), y)
        return jax.lax.ragged_all_to_all(y, out, blocks, arriving, at_source, counts, axis_name=EXPERT_AXIS)
    back = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0, tiled=True)
    return back[_slots(counts, starts, n)]


def _blank(shape: tuple[int, ...], like: Array) -> Array:
    """A zero buffer for a ragged all-to-all to write into, typed as varying
    along the manual axes `like` (its operand) varies along. JAX types the
    collective's result as its output buffer (JAX 0.10.2 to 0.12): a buffer
    invariant over the batch axes would make the received rows invariant too,
    and their cotangents then get summed over those axes (an all-reduce of the
    whole buffer each backward pass, on TPU)."""
    return mark_varying(jnp.zeros(shape, like.dtype), varying_axes(like))


def _slots(counts: Array, starts: Array, n: int) -> Array:
    """The row of each of `n` destination-sorted rows in a buffer of one block of
    `n` rows per destination."""
    device_of = jnp.repeat(jnp.arange(counts.shape[0], dtype=jnp.int32), counts, total_repeat_length=n)
    return device_of * n + jnp.arange(n, dtype=jnp.int32) - starts[device_of]
