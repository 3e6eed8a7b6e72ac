"""A mixture-of-experts feed-forward layer: top-k routing, dropless grouped
matmuls (or capacity-padded batches), optional shared experts and
auxiliary-loss-free balancing."""

import contextlib
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._errors import DivisibilityError, PlanError, SpecError
from .._mesh import EXPERT_AXIS
from .._param import param
from .._trace_notes import TraceNotes
from .._varying import varying_axes
from ._context import tensor_context
from ._linear import MLP, _normal
from ._matmul import check_bias, check_split, lift
from ._moe_config import MoEConfig
from ._moe_dispatch import ragged_exchange, return_rows, send_rows

# The routed activations of every MoE call traced inside `record_dispatches`
# (`eqxpar.inspect.minimum_comm` reads them off the loss's trace).
_DISPATCHES = TraceNotes("eqxpar_moe_dispatches")


def record_dispatches() -> contextlib.AbstractContextManager[list[jax.ShapeDtypeStruct]]:
    """Collect, per `MoE` call traced inside, the outline of its routed
    activations: `(tokens * top_k, d_model)` in the dtype the experts compute in."""
    return _DISPATCHES.record()


_ACTIVATIONS = ("gelu", "swiglu")


class MoEAux(eqx.Module):
    """What an `MoE` call reports besides its output (returned, never added to a
    loss by the layer).

    - `load_balance_loss`: Switch/GShard balance loss `experts * sum_e f_e * P_e`,
      `f_e` the fraction of the `tokens * top_k` routed assignments that chose
      expert `e` (before any capacity drop), `P_e` the mean over tokens of the
      router probability of `e` (softmax scores; sigmoid scores normalised to sum
      1 per token). 1.0 for perfectly uniform routing, `experts` at worst (top-1).
      Differentiable through `P_e` only.
    - `router_z_loss`: mean over tokens of `logsumexp(logits)^2` (ST-MoE).
    - `expert_load`: `(experts,)` float32 counts of routed assignments per expert
      (they sum to `tokens * top_k`); feed them to `update_router_bias`.
    - `dropped_fraction`: the share of assignments dropped by the capacity limit
      (0.0 when dropless).
    """

    load_balance_loss: Float[Array, ""]
    router_z_loss: Float[Array, ""]
    expert_load: Float[Array, " experts"]
    dropped_fraction: Float[Array, ""]


class MoE(eqx.Module):
    """A mixture-of-experts feed-forward layer: each token goes to the `top_k` of
    `experts` expert MLPs its router scores highest, and their outputs are summed
    weighted by those scores.

    Routing: `logits = x @ router` (in float32, float64 for float64 inputs), `scores = softmax(logits)` or
    `sigmoid(logits)` over experts; the `top_k` experts are chosen on
    `scores + router_bias` and combined with weights `scores` of the chosen experts
    (normalised to sum 1 when `normalize_top_k`, then times `route_scale`).
    `router_bias` only steers the choice (auxiliary-loss-free balancing, as in
    DeepSeek-V3): it never enters the combine weights and gets no gradient; move it
    between steps with `update_router_bias(moe, aux.expert_load, rate=...)`. (With
    a weight-decaying optimizer, mask it out or it decays towards 0.)

    Dispatch, by default *dropless*: the `tokens * top_k` assignments are sorted by
    expert and the experts run as grouped matmuls (`jax.lax.ragged_dot`) over their
    contiguous groups, so no token is ever dropped whatever the routing. With
    `capacity_factor=c` each expert takes at most
    `min(ceil(c * tokens * top_k / experts), tokens * top_k)` assignments, as padded
    per-expert batches multiplied by one batched einsum (on a GPU several times
    faster than `ragged_dot`: this layer's forward + backward on an H100, bf16,
    16,384 tokens, d_model 1024, hidden 4096, 8 experts, top-2: 26.4 ms dropless,
    5.5 ms at `capacity_factor=1.25`); priority is by choice rank, then token order (every
    token's first choice before any second choice, as in GShard); an assignment
    over capacity contributes 0 and `aux.dropped_fraction` reports the share.

    Each expert is `w_out act(x @ w_in)` (`activation="gelu"`) or
    `w_out (silu(x @ w_gate) * (x @ w_in))` (`"swiglu"`), weights stacked over
    experts with logical axes `("experts", "embed", "mlp")` / `("experts", "mlp",
    "embed")`, the router `("embed", None)`. `num_shared > 0` adds shared experts:
    one dense `eqxpar.nn.MLP` of hidden size `num_shared * shared_hidden` applied to
    every token, its output added.

    Runs under automatic plans (GSPMD; rules may split `"mlp"`, the experts' hidden
    features, e.g. `rules.MEGATRON`) and inside a `shard_map` over the tensor axis
    (hidden features split: this device's experts' shards, the partial outputs
    summed over the axis; not with sequence parallelism).

    *Expert parallelism*: with the experts split over a mesh `expert` axis of `n`
    devices (`eqxpar.make_mesh(expert=n, ...)`, `rules.EXPERT` or
    `rules.MEGATRON`), each device holds `experts / n` of them and eqxpar's steps
    run manual over that axis: each device routes its own tokens, sends every
    assignment to the device holding its expert with one all-to-all, runs its
    experts on what arrives (from every device of the axis) and sends the outputs
    back with a second; the backward pass runs both transposed. Dropless, the
    receiving buffers have room for the worst case (every assignment of a device
    going to one other: `n * tokens * top_k` rows per device). On TPU the
    exchanges are ragged all-to-alls (`jax.lax.ragged_all_to_all`), which send
    only the rows routed: the routed activations on the wire. Elsewhere (XLA:CPU
    implements no ragged all-to-all) they are padded all-to-alls of the whole
    buffers, `n` times the routed activations; the layer chooses from the
    platform of the plan it is traced under (`MoEConfig(exchange=...)` sets it). With `capacity_factor=c` each device's tokens
    form a group (as in GShard): expert `e` takes at most
    `ceil(c * group tokens * top_k / experts)` of each device's assignments, and
    the buffers are `c` times the routed activations.

    The auxiliary losses are statistics of every token of the step: each device
    routes its own, and the sums behind them are taken over the manual axes the
    tokens differ along (batch, context), so every device reports what one
    device computing the whole batch would (automatic plans compute it whole).
    They are statistics of the tokens of one call, though: a step that splits the
    batch into micro-batches (`accumulate=k`, a pipeline's micro-batches) gets a
    micro-batch's each. `router_z_loss`, a mean over tokens, then averages to the
    batch's exactly; `load_balance_loss`, a product of two batch means, does not,
    so a loss adding it has not the full batch's gradient under accumulation
    (eqxpar warns, `eqxpar.AccumulationWarning`, for an MoE `GPT` whose
    `load_balance_coef` is not 0; it cannot see a hand-written loss's terms).

    **Arguments:**

    - `d_model`: model features; `hidden`: each expert's hidden features.
    - `config`: an `eqxpar.nn.MoEConfig`: `experts`, `top_k`, `score`,
      `normalize_top_k`, `route_scale`, `capacity_factor`, `num_shared`,
      `shared_hidden`, `exchange`.
    - keyword-only: `activation="swiglu" | "gelu"`, `use_bias=False` (expert
      biases), `axis="tensor"`, `dtype=jnp.float32`, `key`.

    **Returns** (calling it): `moe(x) -> (y, aux)`, `x` and `y` of shape
    `(batch, seq, d_model)`, `aux` an `MoEAux`.

    ```python
    moe = eqxpar.nn.MoE(256, 512, eqxpar.nn.MoEConfig(8, top_k=2, num_shared=1), key=key)
    y, aux = moe(x)                                   # x: (batch, seq, 256)
    loss = task_loss + 0.01 * aux.load_balance_loss + 1e-3 * aux.router_z_loss
    moe = eqxpar.nn.update_router_bias(moe, aux.expert_load, rate=1e-3)
    ```
    """

    router: Float[Array, "d_model experts"] = param(axes=("embed", None))
    router_bias: Float[Array, " experts"] = param(axes=(None,))
    w_in: Float[Array, "experts d_model hidden"] = param(axes=("experts", "embed", "mlp"))
    b_in: Float[Array, "experts hidden"] | None = param(axes=("experts", "mlp"))
    w_gate: Float[Array, "experts d_model hidden"] | None = param(axes=("experts", "embed", "mlp"))
    b_gate: Float[Array, "experts hidden"] | None = param(axes=("experts", "mlp"))
    w_out: Float[Array, "experts hidden d_model"] = param(axes=("experts", "mlp", "embed"))
    b_out: Float[Array, "experts d_model"] | None = param(axes=("experts", "embed"))
    shared: MLP | None
    d_model: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)
    experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    score: str = eqx.field(static=True)
    normalize_top_k: bool = eqx.field(static=True)
    route_scale: float = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    exchange: str = eqx.field(static=True, default="auto")

    def __init__(
        self,
        d_model: int,
        hidden: int,
        config: MoEConfig,
        *,
        activation: str = "swiglu",
        use_bias: bool = False,
        axis: str = "tensor",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        _check_arguments(d_model, hidden, config, activation)
        c, experts = config, config.experts
        k_router, k_in, k_gate, k_out, k_shared = jax.random.split(key, 5)
        self.router = _normal(k_router, (d_model, experts), d_model, dtype)
        self.router_bias = jnp.zeros((experts,), dtype)
        self.w_in = _normal(k_in, (experts, d_model, hidden), d_model, dtype)
        self.b_in = jnp.zeros((experts, hidden), dtype) if use_bias else None
        if activation == "swiglu":
            self.w_gate = _normal(k_gate, (experts, d_model, hidden), d_model, dtype)
            self.b_gate = jnp.zeros((experts, hidden), dtype) if use_bias else None
        else:
            self.w_gate = self.b_gate = None
        self.w_out = _normal(k_out, (experts, hidden, d_model), hidden, dtype)
        self.b_out = jnp.zeros((experts, d_model), dtype) if use_bias else None
        self.shared = (
            MLP(
                d_model,
                c.num_shared * (c.shared_hidden or hidden),
                activation=activation,
                use_bias=use_bias,
                axis=axis,
                dtype=dtype,
                key=k_shared,
            )
            if c.num_shared
            else None
        )
        self.d_model, self.hidden, self.experts, self.top_k = d_model, hidden, experts, c.top_k
        self.score, self.normalize_top_k, self.route_scale = c.score, c.normalize_top_k, float(c.route_scale)
        self.activation = activation
        self.capacity_factor = None if c.capacity_factor is None else float(c.capacity_factor)
        self.exchange = c.exchange
        self.axis = axis

    # -- routing ---------------------------------------------------------------

    def route(
        self, x: Float[Array, "tokens d_model"]
    ) -> tuple[
        Array, Float[Array, "tokens top_k"], Float[Array, "tokens experts"], Float[Array, "tokens experts"]
    ]:
        """Route flat tokens: `(indices (tokens, top_k) int32, combine weights
        (tokens, top_k), scores (tokens, experts), logits (tokens, experts))`, in
        float32 (float64 for float64 inputs)."""
        # At least float32 (bfloat16 routing picks other experts); float64 stays
        # float64 under jax_enable_x64.
        dtype = jnp.promote_types(jnp.result_type(x, self.router), jnp.float32)
        logits = jnp.dot(x.astype(dtype), self.router.astype(dtype), precision=jax.lax.Precision.HIGHEST)
        scores = jax.nn.softmax(logits, axis=-1) if self.score == "softmax" else jax.nn.sigmoid(logits)
        bias = jax.lax.stop_gradient(self.router_bias.astype(dtype))
        # Choose on scores + bias; the bias moves no weight, so choose without gradients.
        _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores) + lift(bias, 2), self.top_k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if self.normalize_top_k:
            weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return idx.astype(jnp.int32), weights, scores, logits

    def _aux(self, idx: Array, scores: Array, logits: Array, dropped: Array, over: tuple[str, ...]) -> MoEAux:
        """The auxiliary statistics of every token the layer sees on the devices
        of the manual axes `over` (those the tokens differ along): sums taken
        there, so each device reports the whole batch's values, as one device
        would."""
        total = lambda v: jax.lax.psum(v, over) if over else v  # noqa: E731
        n_assign = total(jnp.asarray(idx.size, jnp.float32))
        n_tokens = n_assign / self.top_k
        load = total(jnp.zeros((self.experts,), jnp.float32).at[idx.reshape(-1)].add(1.0))
        probs = scores if self.score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
        mean_probs = total(jnp.sum(probs, axis=0)) / n_tokens
        balance = self.experts * jnp.sum(load / n_assign * mean_probs)
        z = total(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / n_tokens
        return MoEAux(
            load_balance_loss=balance,
            router_z_loss=z,
            expert_load=load,
            dropped_fraction=total(dropped.astype(jnp.float32)) / n_assign,
        )

    # -- the experts -----------------------------------------------------------

    def _weights(self, dtype) -> tuple:
        cast = lambda w: None if w is None else w.astype(dtype)  # noqa: E731
        weights = (self.w_in, self.b_in, self.w_gate, self.b_gate, self.w_out, self.b_out)
        return tuple(cast(w) for w in weights)

    def _act(self, h: Array, g: Array | None) -> Array:
        return jax.nn.gelu(h) if g is None else jax.nn.silu(g) * h

    def _grouped(self, xs: Array, group_sizes: Array, expert_of: Array, dtype) -> Array:
        """The experts this device holds on rows grouped by expert (expert `e` on
        the next `group_sizes[e]` rows; rows past the groups give outputs nobody
        reads) as grouped matmuls: `(rows, d_model)`, summed over the tensor axis.
        `expert_of`: each row's expert, for the biases."""
        w_in, b_in, w_gate, b_gate, w_out, b_out = self._weights(dtype)
        h = jax.lax.ragged_dot(xs, w_in, group_sizes)
        if b_in is not None:
            h = h + b_in[expert_of]
        g = None
        if w_gate is not None:
            g = jax.lax.ragged_dot(xs, w_gate, group_sizes)
            if b_gate is not None:
                g = g + b_gate[expert_of]
        y = self._psum(jax.lax.ragged_dot(self._act(h, g), w_out, group_sizes))
        return y if b_out is None else y + b_out[expert_of]

    def _grouped_by_source(self, rows: Array, arriving: Array, expert_of: Array, dtype) -> Array:
        """`_grouped` over the receiving buffer of expert parallelism one source's
        block at a time: `(rows, d_model)` in the buffer's layout.

        Block `j` holds source `j`'s rows sorted by local expert (`arriving[j, e]`
        rows for expert `e`), the rest of its room empty: the layout of a grouped
        matmul already, so no row is moved. The buffer has room for the worst
        case, `sources` times the rows a device routes, and the experts' hidden
        activations over it whole were `sources` times one block's: on Mixtral
        8x7B over 8 devices 896 MiB each, three of them live at once in the
        backward pass, beside the buffer regrouped by expert and its cotangent
        (the TPU compiler's buffer assignment). A scan over the blocks whose body
        is rematerialised keeps one block's: its backward recomputes them.
        `expert_of`: each buffer row's local expert, for the biases."""
        sources, local = arriving.shape
        total, d = rows.shape
        n = total // sources

        def block(carry: None, inputs: tuple[Array, Array, Array]) -> tuple[None, Array]:
            xs, sizes, of = inputs
            return carry, self._grouped(xs, sizes, of, dtype)

        inputs = (rows.reshape(sources, n, d), arriving, expert_of.reshape(sources, n))
        _, ys = jax.lax.scan(jax.checkpoint(block), None, inputs)
        return ys.reshape(total, d)

    def _dropless(self, xf: Array, idx: Array, dtype) -> Array:
        """Every assignment through its expert: `(tokens * top_k, d_model)` in
        assignment order (token-major)."""
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        inverse = jnp.argsort(order, stable=True)
        group_sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)
        y = self._grouped(xf[order // self.top_k], group_sizes, flat[order], dtype)
        return y[inverse]

    def _dropless_parallel(self, xf: Array, idx: Array, dtype, ep: int) -> Array:
        """`_dropless` with the experts split over `ep` devices of the `expert` axis:
        `(tokens * top_k, d_model)` in assignment order.

        Each device sorts its assignments by expert (so by the device holding
        it) and sends each device its rows (`_moe_dispatch.send_rows`: a ragged
        all-to-all of the routed rows on TPU, a padded all-to-all elsewhere);
        the receiver runs its local experts on what arrives as grouped
        matmuls, a source's rows at a time, and sends the outputs back. Shapes are static, so the
        receiving buffer has room for the worst case: a block of `tokens *
        top_k` rows per source device. Only the counts per expert cross the
        axis besides the rows (a small all-to-all); each device works out which
        expert each received row is for from them.
        """
        local = self.experts // ep
        n_assign = idx.size
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        per_expert = jnp.bincount(flat, length=self.experts).astype(jnp.int32).reshape(ep, local)
        counts = jnp.sum(per_expert, axis=1)
        starts = jnp.cumsum(counts) - counts
        # What each source sends here, per local expert: (sources, local).
        arriving = jax.lax.all_to_all(per_expert, EXPERT_AXIS, 0, 0, tiled=True)
        from_each = jnp.sum(arriving, axis=1)
        ragged = ragged_exchange(self.exchange)
        rows = send_rows(xf[order // self.top_k], counts, starts, from_each, ragged=ragged)
        # The local expert of each received row (block j: source j's rows, sorted
        # by expert); rows past a block's rows get `local`, a group past the last.
        ends = jnp.cumsum(arriving, axis=1)
        within = jnp.arange(n_assign, dtype=jnp.int32)
        ids = jnp.sum(within[None, :, None] >= ends[:, None, :], axis=2, dtype=jnp.int32).reshape(-1)
        # Bias rows for the empty group read the last expert's: their outputs are never used.
        y = self._grouped_by_source(rows, arriving, jnp.minimum(ids, local - 1), dtype)
        back = return_rows(y, counts, starts, from_each, ragged=ragged)
        # Every row is written: a permutation, not a scatter into zeros (whose
        # cotangent, invariant over the batch axes, would be summed over them).
        return back[jnp.argsort(order)]

    def _expert_split(self) -> tuple[int, tuple[str, ...]]:
        """`(ep, over)`: the devices this call's experts are split over (1: every
        device holds them all) and the manual axes its tokens differ along."""
        abstract = jax.sharding.get_abstract_mesh()
        manual = set(abstract.manual_axes)
        held = self.w_in.shape[0]
        if EXPERT_AXIS in manual and abstract.shape[EXPERT_AXIS] > 1 and held != self.experts:
            ep = abstract.shape[EXPERT_AXIS]
            if held * ep != self.experts:
                raise DivisibilityError(
                    f"MoE holds {held} of its {self.experts} experts on each of the {ep} devices of "
                    f"mesh axis {EXPERT_AXIS!r}; expected {self.experts} / {ep}. Use a number of experts "
                    f"divisible by {ep}, split only over {EXPERT_AXIS!r} (rules.EXPERT)."
                )
        elif held != self.experts:
            raise PlanError(
                f"MoE holds {held} of its {self.experts} experts: its weights are split, but not over a "
                f"manual {EXPERT_AXIS!r} mesh axis, so the tokens of the other experts could not reach "
                f"them. Split experts over {EXPERT_AXIS!r} only (rules.EXPERT), and run the layer in an "
                "eqxpar step (which is manual over that axis) or a shard_map over it."
            )
        else:
            ep = 1
        return ep, tuple(sorted(manual))

    def _capacity(self, xf: Array, idx: Array, dtype, ep: int) -> tuple[Array, Array]:
        """Assignments through capacity-padded per-expert batches: `((tokens *
        top_k, d_model)` token-major, 0 for dropped ones; the number dropped).

        With expert parallelism over `ep > 1` devices the `(experts * capacity,
        d_model)` buffer is laid out by device (each holds `experts / ep`
        consecutive experts), so one all-to-all sends each device its experts'
        batches from every device of the axis, and one more sends the outputs back."""
        assert self.capacity_factor is not None
        w_in, b_in, w_gate, b_gate, w_out, b_out = self._weights(dtype)
        tokens, k, e = idx.shape[0], self.top_k, self.experts
        cap = min(math.ceil(self.capacity_factor * tokens * k / e), tokens * k)
        # Priority: choice rank, then token order.
        by_rank = idx.T.reshape(-1)  # (k * tokens,)
        one_hot = jax.nn.one_hot(by_rank, e, dtype=jnp.int32)
        position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=1)
        keep = position < cap
        slot = jnp.where(keep, by_rank * cap + position, e * cap)  # e * cap: out of range
        slot = slot.reshape(k, tokens).T.reshape(-1)  # token-major, like the assignments
        xs = jnp.repeat(xf, k, axis=0)
        d = xf.shape[1]
        buf = jnp.zeros((e * cap, d), xf.dtype).at[slot].set(xs, mode="drop")
        local = e // ep
        if ep > 1:
            # Rows of device j's experts go to j; what arrives is (source, its
            # experts, capacity): regroup by expert, the sources' rows side by side.
            buf = jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0, tiled=True)
            buf = jnp.swapaxes(buf.reshape(ep, local, cap, d), 0, 1)
        buf = buf.reshape(local, ep * cap, d)
        h = jnp.einsum("ecd,edh->ech", buf, w_in)
        if b_in is not None:
            h = h + b_in[:, None, :]
        g = None
        if w_gate is not None:
            g = jnp.einsum("ecd,edh->ech", buf, w_gate)
            if b_gate is not None:
                g = g + b_gate[:, None, :]
        y = jnp.einsum("ech,ehd->ecd", self._act(h, g), w_out)
        y = self._psum(y)
        if b_out is not None:
            y = y + b_out[:, None, :]
        if ep > 1:
            y = jnp.swapaxes(y.reshape(local, ep, cap, d), 0, 1).reshape(e * cap, d)
            y = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0, tiled=True)
        y = y.reshape(e * cap, d).at[slot].get(mode="fill", fill_value=0)
        return y, jnp.sum(~keep)

    def _psum(self, y: Array) -> Array:
        ctx = tensor_context(self.axis)
        return jax.lax.psum(y, ctx.axis) if ctx.manual else y

    def __call__(self, x: Float[Array, "..."]) -> tuple[Float[Array, "..."], MoEAux]:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise SpecError(
                f"MoE input has shape {tuple(x.shape)}; expected (batch, seq, d_model={self.d_model}). "
                "Reshape to batch-first (batch, seq, features); do not jax.vmap eqxpar.nn layers "
                "over examples."
            )
        ctx = tensor_context(self.axis)
        if ctx.manual and ctx.sequence_parallel:
            raise PlanError(
                f"MoE inside a shard_map over {ctx.axis!r} with sequence_parallel=True is not "
                "supported yet: use a plan without sequence parallelism, or an automatic plan "
                "(mode='auto')."
            )
        check_split(self.w_in.shape[2], self.hidden, ctx, what="MoE.w_in (hidden)")
        check_split(self.w_out.shape[1], self.hidden, ctx, what="MoE.w_out (hidden)")
        check_bias(self.b_in, self.hidden, ctx, what="MoE.b_in", like="MoE.w_in", split=True)
        check_bias(self.b_gate, self.hidden, ctx, what="MoE.b_gate", like="MoE.w_gate", split=True)
        ep, manual = self._expert_split()
        # The aux statistics are summed over the manual axes the tokens differ
        # along (the batch's, the sequence's under context parallelism).
        over = tuple(a for a in manual if a in varying_axes(x))
        batch, seq, d = x.shape
        xf = x.reshape(batch * seq, d)
        idx, weights, scores, logits = self.route(xf)
        dtype = jnp.result_type(x.dtype, self.w_in.dtype)
        _DISPATCHES.note(jax.ShapeDtypeStruct((idx.size, d), dtype))
        if self.capacity_factor is not None:
            ys, dropped = self._capacity(xf.astype(dtype), idx, dtype, ep)
        elif ep > 1:
            ys = self._dropless_parallel(xf.astype(dtype), idx, dtype, ep)
            dropped = jnp.zeros((), jnp.int32)
        else:
            ys = self._dropless(xf.astype(dtype), idx, dtype)
            dropped = jnp.zeros((), jnp.int32)
        ys = ys.reshape(batch * seq, self.top_k, d)
        y = jnp.sum(ys * weights.astype(dtype)[:, :, None], axis=1).reshape(batch, seq, d)
        y = ctx.constrain(y, None, None)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.astype(x.dtype), self._aux(idx, scores, logits, dropped, over)


def _check_arguments(d_model: Any, hidden: Any, config: Any, activation: Any) -> None:
    """The checks of `MoE`'s own arguments (its config checked itself), each
    failing with an eqxpar error naming the argument and what it takes (`Any`: a
    wrong kind of value is what they catch)."""
    for name, value in (("d_model", d_model), ("hidden", hidden)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"MoE({name}={value!r}): expected a positive integer.")
    if not isinstance(config, MoEConfig):
        raise PlanError(
            f"MoE(d_model, hidden, config={config!r}): expected an eqxpar.nn.MoEConfig, e.g. "
            "MoE(256, 512, eqxpar.nn.MoEConfig(8, top_k=2), key=key)."
        )
    if activation not in _ACTIVATIONS:
        raise PlanError(f"MoE(activation={activation!r}): expected one of {_ACTIVATIONS}.")


def update_router_bias(moe: MoE, expert_load: Float[Array, "*layers experts"], *, rate: float) -> MoE:
    """Auxiliary-loss-free balancing (DeepSeek-V3): `moe` with `router_bias +=
    rate * sign(mean(load) - load)`, so under-loaded experts get chosen more often
    and over-loaded ones less. A pure function; call it between steps, outside
    the gradient.

    **Arguments:** `moe` (an `MoE`), `expert_load` (`aux.expert_load`: counts or
    fractions per expert; a stacked `MoE` of `eqxpar.nn.Stacked` takes
    `(layers, experts)`), `rate` (keyword-only: the step size, e.g. 1e-3).

    **Returns:** the new `MoE`.
    """
    load = jnp.asarray(expert_load, jnp.float32)
    if load.shape != moe.router_bias.shape:
        raise SpecError(
            f"update_router_bias: expert_load has shape {tuple(load.shape)}, expected the router "
            f"bias's {tuple(moe.router_bias.shape)} (one entry per expert: aux.expert_load)."
        )
    delta = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return eqx.tree_at(lambda m: m.router_bias, moe, (moe.router_bias + delta).astype(moe.router_bias.dtype))
