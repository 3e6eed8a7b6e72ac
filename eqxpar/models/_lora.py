"""`add_lora` / `merge_lora` / `lora_trainable`: low-rank adapters on a model's
attention and MLP projections, folded back, and the filter that trains only them."""

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, PyTree

from .. import nn
from .._errors import PlanError
from ..nn._lora import adapter_pairs

#: The projections `add_lora` can adapt, and the layer holding each.
TARGETS = {
    "q": "attn",
    "k": "attn",
    "v": "attn",
    "qkv": "attn",
    "o": "attn",
    "gate": "mlp",
    "up": "mlp",
    "down": "mlp",
}
# A projection's input dimensions in its base weight (the rest are outputs);
# base weights: q (d, heads, hd), qkv (d, 3, heads, hd), o (heads, hd, d), down (f, d).
_IN_DIMS = {"q": 1, "k": 1, "v": 1, "qkv": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def _is_layer(x: Any) -> bool:
    return isinstance(x, nn.Attention | nn.MLP)


def _is_moe(x: Any) -> bool:
    return isinstance(x, nn.MoE)


def _is_adapter(x: Any) -> bool:
    return isinstance(x, nn.AttentionLoRA | nn.MLPLoRA)


def _layers(model: PyTree) -> list:
    return [x for x in jax.tree.leaves(model, is_leaf=_is_layer) if _is_layer(x)]


def _map_layers(fn: Callable[[Any], Any], model: PyTree) -> PyTree:
    return jax.tree.map(lambda x: fn(x) if _is_layer(x) else x, model, is_leaf=_is_layer)


def _default_targets(layers: list) -> tuple[str, ...]:
    # PEFT's defaults: Llama's q_proj and v_proj, GPT-2's fused c_attn.
    fused = any(isinstance(layer, nn.Attention) and layer.wqkv is not None for layer in layers)
    return ("qkv",) if fused else ("q", "v")


def _check_targets(targets: Any, layers: list, *, moe: bool) -> tuple[str, ...]:
    if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
        raise PlanError(
            f"add_lora(targets={targets!r}): expected a non-empty tuple of projection names from "
            f"{tuple(TARGETS)}, e.g. targets=('q', 'v')."
        )
    targets = tuple(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise PlanError(
            f"add_lora(targets={targets!r}): {unknown} unknown; expected names from {tuple(TARGETS)}."
        )
    mlp_targets = [t for t in targets if TARGETS[t] == "mlp"]
    if mlp_targets and moe:
        raise PlanError(
            f"add_lora(targets={targets!r}): the model has MoE feed-forwards (eqxpar.nn.MoE), whose "
            f"experts, router and shared experts take no adapters, so {mlp_targets} would adapt only "
            "the dense blocks' MLPs between them (or nothing). Adapt the attention alone, e.g. "
            "targets=('q', 'k', 'v', 'o') ('qkv', 'o' on a fused QKV weight)."
        )
    for layer in layers:
        if isinstance(layer, nn.Attention):
            fused = layer.wqkv is not None
            wrong = [t for t in targets if t in (("q", "k", "v") if fused else ("qkv",))]
            if wrong:
                fix = "'qkv' (one adapter on the fused weight, PEFT's c_attn)" if fused else "'q', 'k', 'v'"
                what = "a fused QKV weight (wqkv)" if fused else "separate wq, wk, wv"
                raise PlanError(
                    f"add_lora(targets={targets!r}): the model's attention has {what}, so {wrong} "
                    f"cannot be adapted on their own. Use {fix}."
                )
        elif "gate" in targets and layer.activation != "swiglu":
            raise PlanError(
                f"add_lora(targets={targets!r}): the model's MLP is {layer.activation!r}, which has no gate "
                "projection (its one input projection is 'up'). Drop 'gate'."
            )
    return targets


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype: Any) -> Array:
    # PEFT's default A: kaiming_uniform_(a=sqrt(5)) over (rank, fan_in), i.e. U(+-1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _pair(key: PRNGKeyArray, lead: tuple, ins: tuple, outs: tuple, rank: int, dtype: Any) -> tuple:
    # A random, B zero: the adapted model starts as the base model.
    a = _uniform(key, (*lead, *ins, rank), math.prod(ins), dtype)
    return a, jnp.zeros((*lead, rank, *outs), dtype)


def _attention_adapter(
    layer: Any, targets: tuple, rank: int, alpha: float, dropout: float, key: PRNGKeyArray
) -> Any:
    lead, dtype = layer.wo.shape[:-3], layer.wo.dtype
    d, h, kv, hd = layer.d_model, layer.num_heads, layer.num_kv_heads, layer.head_dim
    outs = {"q": (h, hd), "k": (kv, hd), "v": (kv, hd), "qkv": (3, h, hd)}
    fields: dict[str, Array] = {}
    keys = dict(zip(("q", "k", "v", "qkv", "o"), jax.random.split(key, 5), strict=True))
    for name in ("q", "k", "v", "qkv"):
        if name in targets:
            fields[f"{name}_a"], fields[f"{name}_b"] = _pair(keys[name], lead, (d,), outs[name], rank, dtype)
    if "o" in targets:
        fields["o_a"], fields["o_b"] = _pair(keys["o"], lead, (h, hd), (d,), rank, dtype)
    return nn.AttentionLoRA(**fields, rank=rank, alpha=alpha, dropout=dropout) if fields else None


def _mlp_adapter(
    layer: Any, targets: tuple, rank: int, alpha: float, dropout: float, key: PRNGKeyArray
) -> Any:
    lead, dtype = layer.w_out.shape[:-2], layer.w_out.dtype
    d, f = layer.d_model, layer.d_hidden
    shapes = {"gate": ((d,), (f,)), "up": ((d,), (f,)), "down": ((f,), (d,))}
    fields: dict[str, Array] = {}
    for name, k in zip(("gate", "up", "down"), jax.random.split(key, 3), strict=True):
        if name in targets:
            fields[f"{name}_a"], fields[f"{name}_b"] = _pair(k, lead, *shapes[name], rank, dtype)
    return nn.MLPLoRA(**fields, rank=rank, alpha=alpha, dropout=dropout) if fields else None


def add_lora(
    model: PyTree,
    *,
    rank: int,
    alpha: int | float | None = None,
    targets: Sequence[str] | None = None,
    dropout: float = 0.0,
    key: PRNGKeyArray,
) -> PyTree:
    """`model` with low-rank adapters (LoRA) on the chosen projections of every
    `eqxpar.nn.Attention` and `eqxpar.nn.MLP` in it (e.g. a `GPT`'s blocks).

    Each adapted projection `W` gains its own pair: `y = x W + alpha / rank *
    (x A) B`, `A` `(in, rank)` drawn as PEFT draws it (uniform in `+-1/sqrt(in)`),
    `B` `(rank, out)` zero, so the model starts as it was. They live in
    `attention.lora` (`eqxpar.nn.AttentionLoRA`) and `mlp.lora`
    (`eqxpar.nn.MLPLoRA`), with a leading layer dimension inside a stack, and
    declare their base's logical axes: every plan shards them with their base
    weights (column-parallel projections: `A` whole, `B` split like the output;
    row-parallel: `A` split like the input, `B` whole). Train them alone with
    `lora_trainable(model)`; fold them in with `merge_lora`; export them with
    `save_lora`.

    An MoE model (one holding `eqxpar.nn.MoE` feed-forwards, e.g. a `GPT` with
    `moe_every`) takes adapters on its attention only: the experts, router and
    shared experts get none, and targets naming `gate`, `up` or `down` raise
    `PlanError` (they would adapt only the dense blocks between the MoE ones).

    **Arguments:**

    - `model`: any pytree holding `eqxpar.nn.Attention` / `MLP` layers, without
      adapters yet.
    - `rank`: the adapters' rank (keyword-only).
    - `alpha`: the scale numerator (keyword-only; default None: `rank`, a scale of 1).
    - `targets`: projections to adapt, from `"q"`, `"k"`, `"v"` (separate
      weights) or `"qkv"` (a fused QKV weight, one adapter: GPT-2's `c_attn`),
      `"o"`, `"gate"` (SwiGLU only), `"up"` (a GELU MLP's input), `"down"`.
      Default None: PEFT's, `("q", "v")`, or `("qkv",)` on fused weights.
    - `dropout`: PEFT's `lora_dropout` (keyword-only; default 0.0, none): each
      adapter's input `x` is dropped at this rate, with a mask of its own, when
      the model is called with a `key` (`GPT(tokens, key=)`, `lm_loss(...,
      key=)`, which `eqxpar.train.make_step` passes each step); without a key
      (evaluation, generation) the adapters see `x` whole. Not under a pipeline
      plan, which passes its stages no key (`PlanError`).
    - `key`: PRNG key for the `A` matrices (keyword-only).

    **Returns:** the model with adapters (a new pytree; `model` is unchanged).

    ```python
    model = eqxpar.models.add_lora(model, rank=8, alpha=16, targets=("q", "k", "v", "o"),
                                   key=jax.random.key(0))
    ```
    """
    layers = _layers(model)
    if not layers:
        raise PlanError(
            "add_lora: the model holds no eqxpar.nn.Attention or eqxpar.nn.MLP layer to adapt; "
            "build it from eqxpar.nn layers (e.g. eqxpar.models.GPT)."
        )
    if any(layer.lora is not None for layer in layers):
        raise PlanError(
            "add_lora: the model already has adapters. Fold them in first (eqxpar.models.merge_lora), "
            "or add every target in one call."
        )
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise PlanError(f"add_lora(rank={rank!r}): expected a positive integer, e.g. rank=8.")
    alpha = float(rank if alpha is None else alpha)
    if not math.isfinite(alpha) or alpha <= 0:
        raise PlanError(f"add_lora(alpha={alpha!r}): expected a positive number (the scale is alpha / rank).")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        raise PlanError(f"add_lora(dropout={dropout!r}): expected a rate in [0, 1) (0: no dropout).")
    dropout = float(dropout)
    moe = any(isinstance(x, nn.MoE) for x in jax.tree.leaves(model, is_leaf=_is_moe))
    targets = _check_targets(_default_targets(layers) if targets is None else targets, layers, moe=moe)
    keys = iter(jax.random.split(key, len(layers)))

    def adapt(layer: Any) -> Any:
        make = _attention_adapter if isinstance(layer, nn.Attention) else _mlp_adapter
        lora = make(layer, targets, rank, alpha, dropout, next(keys))
        return layer if lora is None else eqx.tree_at(lambda m: m.lora, layer, lora, is_leaf=_is_none)

    return _map_layers(adapt, model)


def _is_none(x: Any) -> bool:
    return x is None


def _delta(a: Array, b: Array, scale: float, in_dims: int) -> Array:
    """`scale * a @ b` over the rank, shaped as the base weight: `a` `(*lead, *in,
    rank)`, `b` `(*lead, rank, *out)` -> `(*lead, *in, *out)`."""
    lead = a.shape[: a.ndim - 1 - in_dims]
    ins, outs, rank = a.shape[len(lead) : -1], b.shape[len(lead) + 1 :], a.shape[-1]
    a2 = a.reshape(*lead, math.prod(ins), rank)
    b2 = b.reshape(*lead, rank, math.prod(outs))
    product = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST) * jnp.asarray(scale, a.dtype)
    return product.reshape(*lead, *ins, *outs)


def _merge_layer(layer: Any) -> Any:
    lora = layer.lora
    if lora is None:
        return layer
    if isinstance(layer, nn.Attention):
        bases = {"q": "wq", "k": "wk", "v": "wv", "qkv": "wqkv", "o": "wo"}
        for name, a, b in adapter_pairs(lora, tuple(bases)):
            w = getattr(layer, bases[name])
            merged = w + _delta(a, b, lora.scale, _IN_DIMS[name]).astype(w.dtype)
            layer = eqx.tree_at(lambda m, f=bases[name]: getattr(m, f), layer, merged)
    else:
        w_in = layer.w_in
        slots = {"up": 0} if w_in.shape[-2] == 1 else {"gate": 0, "up": 1}
        for name, a, b in adapter_pairs(lora, ("gate", "up")):
            w_in = w_in.at[..., slots[name], :].add(_delta(a, b, lora.scale, 1).astype(w_in.dtype))
        layer = eqx.tree_at(lambda m: m.w_in, layer, w_in)
        for _, a, b in adapter_pairs(lora, ("down",)):
            merged = layer.w_out + _delta(a, b, lora.scale, 1).astype(layer.w_out.dtype)
            layer = eqx.tree_at(lambda m: m.w_out, layer, merged)
    return eqx.tree_at(lambda m: m.lora, layer, None)


def merge_lora(model: PyTree) -> PyTree:
    """`model` with every adapter folded into its base weight (`W + alpha / rank *
    A B`) and removed: the plain model, computing what the adapted one computes,
    for `eqxpar.models.save_pretrained` or inference. Works on a sharded model
    (the products keep the base weights' shardings).

    **Arguments:** `model`, a pytree with adapters from `add_lora` (layers
    without adapters pass through).

    **Returns:** the model without adapters.

    ```python
    eqxpar.models.save_pretrained(eqxpar.models.merge_lora(state.model), "merged")
    ```
    """
    return _map_layers(_merge_layer, model)


def lora_trainable(model: PyTree) -> PyTree:
    """The filter that trains only the adapters: a pytree of bools of `model`'s
    structure, True exactly on the adapters' arrays (the `A` and `B` of every
    `eqxpar.nn.AttentionLoRA` / `MLPLoRA`), False on every other leaf. What
    `eqxpar.train.init` / `make_step` take as `trainable` (frozen leaves get no
    optimizer state and no gradient), or `eqx.partition`'s filter.

    **Arguments:** `model`, a pytree with adapters from `add_lora`.

    **Returns:** a pytree of bools of the same structure.

    ```python
    trainable = eqxpar.models.lora_trainable(model)
    adapters, frozen = eqx.partition(model, trainable)
    ```
    """
    if not any(_is_adapter(x) for x in jax.tree.leaves(model, is_leaf=_is_adapter)):
        raise PlanError(
            "lora_trainable: the model has no adapters, so nothing would train. Add them first: "
            "model = eqxpar.models.add_lora(model, rank=..., key=...)."
        )
    return jax.tree.map(
        lambda x: jax.tree.map(lambda _: True, x) if _is_adapter(x) else False, model, is_leaf=_is_adapter
    )


def has_lora(model: PyTree) -> bool:
    """Whether any `eqxpar.nn.Attention` / `MLP` of `model` has adapters."""
    return any(layer.lora is not None for layer in _layers(model))


def without_lora(model: PyTree) -> PyTree:
    """`model` with its adapters switched off: every `eqxpar.nn.Attention` and
    `eqxpar.nn.MLP` without its `lora`, computing what the base model computes.

    The result shares every base weight with `model` (a new pytree of the same
    arrays, no copy), so inside a step it is the base model at no memory cost:
    what `dpo_loss` uses as the reference of an adapted model (PEFT's
    `disable_adapter()`).

    **Arguments:** `model`, a pytree with adapters from `add_lora`.

    **Returns:** the model without adapters.

    ```python
    base_logits = eqxpar.models.without_lora(model)(tokens)
    ```
    """
    if not has_lora(model):
        raise PlanError(
            "without_lora: the model has no adapters to switch off. Add them with "
            "eqxpar.models.add_lora(model, rank=..., key=...)."
        )
    return _map_layers(
        lambda layer: layer if layer.lora is None else eqx.tree_at(lambda m: m.lora, layer, None), model
    )
