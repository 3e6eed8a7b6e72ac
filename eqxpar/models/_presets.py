"""Published model shapes as `GPTConfig`s, named the way their users name them."""

import dataclasses
from typing import Any

from .._errors import PlanError
from ._gpt import GPTConfig

# The shapes of the published checkpoints (their Hugging Face config.json files):
# widths, heads, layers, vocabulary, rotary base and norm epsilon. max_seq_len is
# the context each was trained for.
_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        vocab_size=50257,
        d_model=768,
        num_heads=12,
        num_layers=12,
        d_hidden=3072,
        activation="gelu",
        norm="layer",
        tied=True,
        rotary=False,
        learned_positions=True,
        use_bias=True,
        fused_qkv=True,
        max_seq_len=1024,
        norm_eps=1e-5,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        num_layers=32,
        d_hidden=14336,
        tied=False,
        rotary_base=500000.0,
        max_seq_len=8192,
        norm_eps=1e-5,
    ),
    "llama3-70b": dict(
        vocab_size=128256,
        d_model=8192,
        num_heads=64,
        num_kv_heads=8,
        num_layers=80,
        d_hidden=28672,
        tied=False,
        rotary_base=500000.0,
        max_seq_len=8192,
        norm_eps=1e-5,
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        num_layers=32,
        d_hidden=14336,
        tied=False,
        rotary_base=1000000.0,
        max_seq_len=32768,
        norm_eps=1e-5,
        moe_every=1,
        experts=8,
        top_k=2,
        load_balance_coef=0.02,
        router_z_coef=0,
    ),
}

#: The names `preset` takes: `("gpt2", "llama3-8b", "llama3-70b", "mixtral-8x7b")`.
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The `GPTConfig` of a published model, by the name its users give it.

    `"gpt2"` (124M), `"llama3-8b"`, `"llama3-70b"` and `"mixtral-8x7b"`: the widths,
    heads, layers, vocabulary, activation, norm, positions and (for Mixtral) the
    routing of the released checkpoints. Any field can be overridden, e.g. a
    shorter `max_seq_len`, or `num_layers` to compile a slice of the model.

    **Arguments:** `name`: one of `eqxpar.models.PRESET_NAMES`; `overrides`: any
    `GPTConfig` field.

    **Returns:** a `GPTConfig`.

    ```python
    config = eqxpar.models.preset("llama3-8b")
    outline = eqx.filter_eval_shape(eqxpar.models.GPT, config, key=jax.random.key(0))
    ```
    """
    if name not in _PRESETS:
        raise PlanError(f"preset({name!r}): unknown model; expected one of {list(PRESET_NAMES)}.")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise PlanError(f"preset({name!r}, {unknown[0]}=...): GPTConfig has no field {unknown[0]!r}.")
    return GPTConfig(**{**_PRESETS[name], **overrides})
