"""Sampling from a `GPT` with a key/value cache: `generate`, and `lower_generate`
for its program compiled from shapes."""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .. import nn
from .._errors import PlanError, SpecError
from .._outline_jit import OutlineJit
from .._plan import Plan, current_plan
from .._shard_map import filter_shard_map
from .._specs import partition_specs
from .._train._resolved_plan import ResolvedPlan
from .._train._step_layout import DecodeLayout
from ..nn._kv_cache import cached_block
from ._gpt import GPT


class Generation(NamedTuple):
    """What `generate` returns.

    **Fields:**

    - `tokens`: `(batch, prompt + steps)` ids (`(prompt + steps,)` for an unbatched
      prompt): the prompt as given, padding included, then the generated tokens.
      A row that produced a stop token repeats it to the end.
    - `logprobs`: `(batch, steps)` float32, the log-probability of each generated
      token under the model's next-token distribution (the log-softmax of its
      logits, before temperature, top-k or top-p); 0 after a row's stop token.
    - `lengths`: `(batch,)` int32, the tokens each row generated, its stop token
      included (`steps` for a row that never stopped).
    """

    tokens: Int[Array, "*batch total"]
    logprobs: Float[Array, "*batch steps"]
    lengths: Int[Array, "*batch"]


def generate(
    model: GPT,
    prompt_ids: Int[Array, "*batch prompt"],
    *,
    steps: int,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    prompt_lengths: Int[ArrayLike, " rows"] | Sequence[int] | None = None,
    max_length: int | None = None,
    plan: Plan | None = None,
) -> Generation:
    """Sample `steps` tokens after `prompt_ids` with a key/value cache.

    One forward pass over the prompt (the prefill) writes every layer's keys and
    values into a cache of `max_length` slots; each new token then runs the model
    on that one token, attending over the cache. Prompt length, `steps` and the
    sampling settings are traced: one compilation per `(batch, max_length)` (and
    number of stop tokens). The loop ends early once every row has produced a
    stop token.

    Rows of different lengths go in one batch left-padded: row `b`'s prompt is its
    last `prompt_lengths[b]` ids, the padding before them is never attended to, and
    its positions count from its first real token, so a row decodes as it would
    alone. Every row's new tokens start at column `prompt`.

    Sampling, per row and step, from the logits: greedy (`temperature=0`), or
    divided by `temperature`, then kept to the `top_k` most likely tokens, then to
    the smallest set whose probability reaches `top_p`. Each row draws with its
    own key (`fold_in` of the step's key and the row's index), so the tokens do not
    depend on how the batch is split over devices.

    Under a plan (`plan=`, or the one entered with `with plan:`) the cache is
    sharded like the attention it serves: heads over the tensor axis where the
    rules split them, batch over the plan's batch axes (the batch must be a
    multiple of their size). `mode="auto"` plans run it under `jit` (GSPMD);
    `mode="manual"` ones run the prefill and each step inside `shard_map` with
    the heads split, the vocabulary-split logits gathered for sampling. Sequence
    parallelism is turned off for generation (one token has no sequence to split).
    Pipelines, context parallelism and expert parallelism are refused with a
    `PlanError` naming the alternative. Without a plan it runs under `jit` on the
    model's arrays as they are placed.

    **Arguments:**

    - `model`: a `GPT`.
    - `prompt_ids`: `(prompt,)` or `(batch, prompt)` ids, `prompt >= 1`.
    - `steps`: number of tokens to add (keyword-only, like all the rest).
    - `key`: PRNG key for sampling.
    - `temperature`: `0` picks the most likely token (greedy); else the logits
      are divided by it (default 1.0).
    - `top_k`: keep the `top_k` most likely tokens (default 0: all).
    - `top_p`: nucleus sampling: keep the most likely tokens until their
      probability reaches `top_p`, in `(0, 1]` (default 1.0: all).
    - `stop_tokens`: ids that end a row (default none).
    - `prompt_lengths`: `(batch,)` real prompt tokens per row, from 1 to `prompt`
      (default: every row is `prompt` long).
    - `max_length`: cache slots, at least `prompt + steps` (default exactly that);
      pass the same value for calls with different prompts or steps to share one
      compilation. A model with learned positions takes at most
      `config.max_seq_len`; a rotary one may go further (positions it was not
      trained at).
    - `plan`: an `eqxpar.Plan` (default: the current one, if any).

    **Returns:** a `Generation`: `tokens` `(batch, prompt + steps)`, `logprobs`
    `(batch, steps)`, `lengths` `(batch,)` (without the batch dimension for an
    unbatched prompt).

    ```python
    out = eqxpar.models.generate(model, prompt, steps=200, key=jax.random.key(0),
                                 temperature=0.8, top_p=0.95)
    ids, logprobs = out.tokens, out.logprobs
    ```
    """
    plan = current_plan() if plan is None else plan
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"generate(plan={plan!r}): expected an eqxpar.Plan or None.")
    resolved = None if plan is None else ResolvedPlan.of(plan)
    inputs = _DecodeInputs.of(
        model, prompt_ids, steps, temperature, top_k, top_p, stop_tokens, prompt_lengths, max_length, resolved
    )
    if steps == 0:
        batch = inputs.buffer.shape[0]
        out = Generation(
            jnp.asarray(inputs.buffer), jnp.zeros((batch, 0), jnp.float32), jnp.zeros((batch,), jnp.int32)
        )
    else:
        tokens, logprobs, count = _decode(model, *inputs.arguments(key))
        out = Generation(tokens[:, : inputs.total], logprobs[:, inputs.width : inputs.total], count)
    return out if prompt_ids.ndim == 2 else Generation(*(x[0] for x in out))


def lower_generate(
    model: GPT,
    prompt_ids: Int[Array, "batch prompt"] | jax.ShapeDtypeStruct,
    *,
    steps: int,
    stop_tokens: Sequence[int] = (),
    max_length: int | None = None,
    plan: Plan | None = None,
) -> jax.stages.Lowered:
    """Lower the program `generate` runs (the prefill of the prompt and the
    decode loop over the key/value cache, one program), from arrays or outlines;
    nothing runs and, from outlines, nothing is allocated.

    The sampling settings, the key and the prompt lengths are traced inputs of
    that program, so they do not change it; the prompt's shape, `max_length`
    (default `prompt + steps`), the number of stop tokens and the plan do.
    `.compile()` gives its memory (the cache included) and HLO, for a model or a
    TPU topology this machine could not hold.

    **Arguments:** `model`: a `GPT`, or its outline (built under
    `eqx.filter_eval_shape`); `prompt_ids`: `(batch, prompt)` ids or a
    `jax.ShapeDtypeStruct` of them; `steps`, `stop_tokens`, `max_length`, `plan`:
    as `generate` takes them.

    **Returns:** a `jax.stages.Lowered`.

    ```python
    outline = eqx.filter_eval_shape(eqxpar.models.GPT, config, key=jax.random.key(0))
    prompt = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    compiled = eqxpar.models.lower_generate(outline, prompt, steps=128, plan=plan).compile()
    ```
    """
    if not isinstance(prompt_ids, jax.ShapeDtypeStruct) and np.ndim(prompt_ids) != 2:
        raise SpecError(
            f"lower_generate: prompt_ids of shape {np.shape(prompt_ids)}; expected (batch, prompt)."
        )
    plan = current_plan() if plan is None else plan
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"lower_generate(plan={plan!r}): expected an eqxpar.Plan or None.")
    resolved = None if plan is None else ResolvedPlan.of(plan)
    inputs = _DecodeInputs.of(model, prompt_ids, steps, 1.0, 0, 1.0, stop_tokens, None, max_length, resolved)
    if steps == 0:
        raise PlanError("lower_generate(steps=0): generate runs no program for 0 steps; pass steps >= 1.")
    return _decode.lower(model, *inputs.arguments(jax.random.key(0)))


class _DecodeInputs(NamedTuple):
    """`generate`'s checked inputs and the decode program's arguments."""

    buffer: Any
    pads: Any
    stops: np.ndarray
    scalars: dict
    layout: DecodeLayout | None
    width: int
    total: int

    @classmethod
    def of(
        cls,
        model: Any,
        prompt_ids: Any,
        steps: Any,
        temperature: Any,
        top_k: Any,
        top_p: Any,
        stop_tokens: Sequence[int],
        prompt_lengths: Any,
        max_length: Any,
        resolved: ResolvedPlan | None,
    ) -> "_DecodeInputs":
        if not isinstance(model, GPT):
            raise PlanError(f"generate(model={type(model).__name__}): expected an eqxpar.models.GPT.")
        shape = tuple(prompt_ids.shape)
        if len(shape) not in (1, 2) or shape[-1] < 1:
            raise SpecError(
                f"generate: prompt_ids of shape {shape}; expected (prompt,) or (batch, prompt) "
                "with at least one token."
            )
        _check_settings(steps, temperature, top_k, top_p)
        outline = isinstance(prompt_ids, jax.ShapeDtypeStruct)
        batch, width = (1, *shape) if len(shape) == 1 else shape
        total = width + steps
        length = total if max_length is None else max_length
        _check_length(model, length, total, max_length)
        lengths = _prompt_lengths(prompt_lengths, batch, width)
        layout = None if resolved is None else DecodeLayout.resolve(resolved, batch)
        stops = _stop_tokens(stop_tokens, model.config.vocab_size)
        if outline:
            buffer = jax.ShapeDtypeStruct((batch, length), prompt_ids.dtype)
        else:
            prompt = prompt_ids if isinstance(prompt_ids, jax.core.Tracer) else np.asarray(prompt_ids)
            prompt = prompt if prompt.ndim == 2 else prompt[None]
            # Built on the host where the prompt is concrete: each eager device op
            # would compile a small program of its own.
            xp = jnp if isinstance(prompt, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer) else np
            buffer = xp.concatenate([prompt, xp.zeros((batch, length - width), prompt.dtype)], axis=1)
        scalars = dict(
            width=np.asarray(width, np.int32),
            steps=np.asarray(steps, np.int32),
            temperature=np.asarray(temperature, np.float32),
            top_k=np.asarray(top_k, np.int32),
            top_p=np.asarray(top_p, np.float32),
        )
        return cls(buffer, width - lengths, stops, scalars, layout, width, total)

    def arguments(self, key: Any) -> tuple:
        """`_decode`'s arguments after the model."""
        return self.buffer, self.pads, self.stops, key, self.scalars, self.layout


def _check_settings(steps: object, temperature: object, top_k: object, top_p: object) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise PlanError(f"generate(steps={steps!r}): expected a non-negative integer.")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature >= 0):
        raise PlanError(
            f"generate(temperature={temperature!r}): expected a finite number >= 0 (0 is greedy)."
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise PlanError(f"generate(top_k={top_k!r}): expected an integer >= 0 (0 keeps every token).")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise PlanError(f"generate(top_p={top_p!r}): expected a number in (0, 1] (1 keeps every token).")


def _check_length(model: GPT, length: object, total: int, given: int | None) -> None:
    if not isinstance(length, int) or isinstance(length, bool) or length < total:
        raise PlanError(
            f"generate(max_length={given!r}): the cache needs a slot for each of the prompt's and "
            f"the generated tokens, {total}. Pass max_length >= {total}, or None."
        )
    limit = model.config.max_seq_len
    if model.positions is not None and length > limit:
        raise PlanError(
            f"generate: {length} cache slots (prompt + steps, or max_length) for a model with a learned "
            f"position table of config.max_seq_len={limit} rows. Generate at most {limit} tokens in all."
        )


def _prompt_lengths(given: object, batch: int, width: int) -> ArrayLike:
    if given is None:
        return np.full((batch,), width, np.int32)
    lengths = given if isinstance(given, jax.core.Tracer) else np.asarray(given)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise SpecError(
            f"generate(prompt_lengths=...): shape {lengths.shape}, dtype {lengths.dtype}; expected "
            f"({batch},) integers, one per prompt row."
        )
    if not isinstance(lengths, jax.core.Tracer) and (lengths.min() < 1 or lengths.max() > width):
        raise SpecError(
            f"generate(prompt_lengths={lengths.tolist()}): each row's prompt is its last "
            f"prompt_lengths[b] ids (left padding), so each must be from 1 to {width}."
        )
    return lengths.astype(np.int32)


def _stop_tokens(stop_tokens: Sequence[int], vocab: int) -> np.ndarray:
    ids = list(stop_tokens)
    for t in ids:
        if not isinstance(t, int | np.integer) or not 0 <= t < vocab:
            raise PlanError(f"generate(stop_tokens={ids!r}): expected token ids from 0 to {vocab - 1}.")
    # -1 matches no token: the array keeps at least one entry.
    return np.asarray(ids or [-1], np.int32)


def _decode_program(
    model: GPT, buffer: Array, pads: Array, stops: Array, key: Array, s: dict, layout: DecodeLayout | None
) -> tuple[Array, Array, Array]:
    if layout is None:
        return _run(model, buffer, pads, stops, key, s, None)
    with layout.plan:
        return _run(model, buffer, pads, stops, key, s, layout)


_decode = OutlineJit(_decode_program, what="generate")


def _run(
    model: GPT, buffer: Array, pads: Array, stops: Array, key: Array, s: dict, layout: DecodeLayout | None
) -> tuple[Array, Array, Array]:
    model = nn.in_natural_order(model)
    batch, length = buffer.shape
    forward = _forward_fn(model, layout)
    cache = _empty_cache(model, batch, length, layout)
    slots = jnp.arange(length)
    positions = slots[None, :] - pads[:, None]
    prefill = dict(
        positions=jnp.maximum(positions, 0), segment_ids=(positions >= 0).astype(jnp.int32), key_mask=None
    )
    logits, cache = forward(model, buffer, cache, jnp.zeros((), jnp.int32), s["width"] - 1, prefill)
    end = s["width"] + s["steps"]

    def cond(carry):
        t, *_, done, _, _ = carry
        return (t < end) & ~jnp.all(done)

    def body(carry):
        t, tokens, logprobs, cache, logits, done, fill, count = carry
        token, logprob = _sample(logits, jax.random.fold_in(key, t), s)
        # A row that stopped repeats its stop token, with log-probability 0.
        token = jnp.where(done, fill, token.astype(tokens.dtype))
        logprob = jnp.where(done, 0.0, logprob)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], t, axis=1)
        logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, logprob[:, None], t, axis=1)
        count = count + (~done).astype(jnp.int32)
        fill = jnp.where(done, fill, token)
        done = done | jnp.any(token[:, None] == stops[None, :], axis=1)
        step = dict(
            positions=(t - pads)[:, None],
            segment_ids=None,
            key_mask=((slots[None, :] >= pads[:, None]) & (slots[None, :] <= t))[:, None, :],
        )
        logits, cache = forward(model, token[:, None], cache, t, jnp.zeros((), jnp.int32), step)
        return t + 1, tokens, logprobs, cache, logits, done, fill, count

    zeros = jnp.zeros((batch,), jnp.int32)
    init = (s["width"], buffer, jnp.zeros(buffer.shape, jnp.float32), cache, logits)
    init = (*init, jnp.zeros((batch,), bool), zeros.astype(buffer.dtype), zeros)
    _, tokens, logprobs, _, _, _, fill, count = jax.lax.while_loop(cond, body, init)
    # The loop ends early once every row has stopped: fill the rest.
    after = slots[None, :] >= s["width"] + count[:, None]
    return jnp.where(after, fill[:, None], tokens), jnp.where(after, 0.0, logprobs), count


def _sample(logits: Array, key: Array, s: dict) -> tuple[Array, Array]:
    """The next token of each row, and its log-probability under the model."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    temperature, top_k, top_p = s["temperature"], s["top_k"], s["top_p"]

    def draw(logits: Array) -> Array:
        scaled = logits / jnp.where(temperature == 0, 1.0, temperature)
        # The sort costs a pass over the vocabulary: only when a filter is on.
        scaled = jax.lax.cond((top_k > 0) | (top_p < 1), _filter, lambda x, _k, _p: x, scaled, top_k, top_p)
        keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits.shape[0]))
        return jax.vmap(jax.random.categorical)(keys, scaled)

    token = jax.lax.cond(temperature == 0, lambda x: jnp.argmax(x, axis=-1), draw, logits)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=1)[:, 0]


def _filter(scaled: Array, top_k: Array, top_p: Array) -> Array:
    """`scaled` with every token outside the top-k, then outside the top-p
    nucleus of what is left, at -inf (ties with the last kept token are kept)."""
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    in_k = rank < jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    # A token is kept while the probability before it is short of top_p: the first always.
    kept = in_k & (jnp.cumsum(probs, axis=-1) - probs < top_p)
    cutoff = jnp.take_along_axis(desc, jnp.sum(kept, axis=-1, keepdims=True) - 1, axis=-1)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _first_attention(blocks: object) -> object:
    # The attention of a stack's first block (a dense block, or an MoE group's last).
    return blocks.moe.attn if hasattr(blocks, "moe") else blocks.attn


def _cache_spec(model: GPT, layout: DecodeLayout) -> PartitionSpec:
    # The heads split as the rules split the attention's key heads (after the
    # stack's leading layer dimension: (layers, d_model, [3,] heads, head_dim)).
    attn = _first_attention(partition_specs(model, layout.plan).blocks.blocks)
    spec, dim = (attn.wqkv, 3) if attn.wk is None else (attn.wk, 2)
    return layout.cache_spec(spec[dim] if len(spec) > dim else None)


def _empty_cache(model: GPT, batch: int, length: int, layout: DecodeLayout | None) -> tuple[Array, Array]:
    attn = _first_attention(model.blocks.blocks)
    per_row = model.config.moe_every or 1
    shape = (model.blocks.layers, per_row, batch, length, attn.num_kv_heads, attn.head_dim)
    k = jnp.zeros(shape, attn.wo.dtype)
    if layout is not None:
        k = jax.lax.with_sharding_constraint(k, layout.plan.sharding(_cache_spec(model, layout)))
    return k, k


def _forward(
    model: GPT,
    ids: Array,
    cache: tuple[Array, Array],
    start: Array,
    last: Array,
    positions: Array,
    segment_ids: Array | None,
    key_mask: Array | None,
) -> tuple[Array, tuple[Array, Array]]:
    """The model on `ids` at cache slots `start, ...`: the float32 logits of the
    token at `last` (index into `ids`), every vocabulary column; the cache updated."""
    h = model.embed(ids)
    if model.positions is not None:
        h = h + jnp.take(model.positions, positions, axis=0)
    arrays, static = eqx.partition(model.blocks.blocks, eqx.is_array)
    attend = dict(positions=positions, start=start, segment_ids=segment_ids, key_mask=key_mask)

    def layer(carry, row):
        h, ck, cv = carry
        params, i = row
        group = eqx.combine(params, static)
        blocks = (*group.dense, group.moe) if model.config.moe_every else (group,)
        for j, block in enumerate(blocks):
            h, k, v = cached_block(block, h, ck[i, j], cv[i, j], **attend)
            ck, cv = ck.at[i, j].set(k), cv.at[i, j].set(v)
        return (h, ck, cv), None

    rows = jnp.arange(model.blocks.layers)
    (h, ck, cv), _ = jax.lax.scan(layer, (h, *cache), (arrays, rows))
    h = jax.lax.dynamic_slice_in_dim(h, last, 1, axis=1)
    logits = model.logits(h)[:, 0].astype(jnp.float32)
    head = model.embed if model.head is None else model.head
    ctx = nn.tensor_context(head.axis)
    if ctx.manual and head.vocab_split():
        logits = jax.lax.all_gather(logits, ctx.axis, axis=1, tiled=True)
    return logits, (ck, cv)


def _forward_fn(model: GPT, layout: DecodeLayout | None):
    """`forward(model, ids, cache, start, last, kw)`: `_forward`, inside
    `shard_map` under a manual plan."""
    if layout is None or not layout.manual:
        return lambda m, ids, cache, start, last, kw: _forward(m, ids, cache, start, last, **kw)
    layout.check_weights(partition_specs(model, layout.plan))
    rows, cache = PartitionSpec(layout.batch_axes or None), _cache_spec(model, layout)
    region = filter_shard_map(
        _forward,
        layout.plan,
        in_specs=(None, rows, (cache, cache), PartitionSpec(), PartitionSpec(), rows, rows, rows),
        out_specs=(rows, (cache, cache)),
        axis_names=layout.manual_axes,
        # The logits are gathered whole on every device, and an MoE block's output
        # is typed as varying over the size-1 expert axis: the values are what the
        # specs say, the type check would refuse them.
        check_vma=False,
    )
    return lambda m, ids, cache, start, last, kw: region(
        m, ids, cache, start, last, kw["positions"], kw["segment_ids"], kw["key_mask"]
    )
