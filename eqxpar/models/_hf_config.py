"""Hugging Face `config.json` <-> `GPTConfig`, for the architectures eqxpar reads:
each field is either honoured exactly or refused with the field's name."""

from typing import Any

from .. import nn
from .._errors import PretrainedError
from ._gpt import GPTConfig

LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")
ARCHITECTURES = (*LLAMA_LIKE, "gpt2")
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def _refuse(field: str, value: Any, expected: str, fix: str = "") -> PretrainedError:
    return PretrainedError(
        f"from_pretrained: config.json has {field}={value!r}; eqxpar's GPT supports {expected}, so it "
        f"cannot load this model exactly and will not load a different one. {fix}".rstrip()
    )


def _need(hf: dict[str, Any], field: str) -> Any:
    if field not in hf:
        raise PretrainedError(
            f"from_pretrained: config.json has no {field!r} field, which a {hf.get('model_type')!r} "
            "config needs. The file is incomplete: take config.json from the checkpoint's repository."
        )
    return hf[field]


def _rotary(hf: dict[str, Any]) -> tuple[float, nn.RotaryScaling | None]:
    # transformers writes rope_theta / rope_scaling, or (newer) one rope_parameters dict.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise _refuse(
            "rope_scaling.rope_type",
            kind,
            "'default' and 'llama3' rotary frequencies",
            "Other scalings (linear, dynamic, yarn, longrope) are not implemented.",
        )
    try:
        scaling = nn.RotaryScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise PretrainedError(
            f"from_pretrained: config.json's llama3 rope_scaling lacks {e.args[0]!r}; it needs factor, "
            "low_freq_factor, high_freq_factor and original_max_position_embeddings."
        ) from e
    return float(theta), scaling


def _llama_like(hf: dict[str, Any], kind: str) -> GPTConfig:
    heads = _need(hf, "num_attention_heads")
    d_model = _need(hf, "hidden_size")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "'silu' (SwiGLU) MLPs for this architecture")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != d_model:
        raise _refuse(
            "head_dim", head_dim, f"head_dim = hidden_size / num_attention_heads = {d_model // heads}"
        )
    window = hf.get("sliding_window")
    # Qwen2 keeps a sliding_window value but uses it only with use_sliding_window.
    windowed = hf.get("use_sliding_window", False) if kind == "qwen2" else window is not None
    if windowed and window is not None and window < hf.get("max_position_embeddings", float("inf")):
        raise _refuse(
            "sliding_window",
            window,
            "full causal attention only (no sliding window)",
            "Use a checkpoint without one (Mistral v0.2 and later set sliding_window=null).",
        )
    attention_bias = bool(hf.get("attention_bias", False))
    mlp_bias = bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise _refuse(
            "attention_bias",
            attention_bias,
            f"attention_bias equal to mlp_bias (here {mlp_bias}): one use_bias for every projection",
        )
    base, scaling = _rotary(hf)
    moe: dict[str, Any] = {}
    if kind == "mixtral":
        jitter = hf.get("router_jitter_noise", 0.0)
        if jitter:
            raise _refuse("router_jitter_noise", jitter, "routers without noise (0.0)")
        coef = hf.get("router_aux_loss_coef", 0.001) if hf.get("output_router_logits", False) else 0.0
        moe = dict(
            moe_every=1,
            experts=_need(hf, "num_local_experts"),
            top_k=hf.get("num_experts_per_tok", 2),
            load_balance_coef=float(coef),
            router_z_coef=0.0,
        )
    return GPTConfig(
        vocab_size=_need(hf, "vocab_size"),
        d_model=d_model,
        num_heads=heads,
        num_layers=_need(hf, "num_hidden_layers"),
        d_hidden=_need(hf, "intermediate_size"),
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        activation="swiglu",
        norm="rms",
        tied=bool(hf.get("tie_word_embeddings", False)),
        rotary=True,
        rotary_base=base,
        rotary_scaling=scaling,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        use_bias=attention_bias,
        qkv_bias=True if kind == "qwen2" else None,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        **moe,
    )


def _gpt2(hf: dict[str, Any]) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _refuse("activation_function", act, "'gelu_new' (GELU, tanh approximation)")
    for field, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(field, ok) != ok:
            raise _refuse(field, hf[field], f"{field}={ok}")
    d_model = _need(hf, "n_embd")
    return GPTConfig(
        vocab_size=_need(hf, "vocab_size"),
        d_model=d_model,
        num_heads=_need(hf, "n_head"),
        num_layers=_need(hf, "n_layer"),
        d_hidden=hf.get("n_inner") or 4 * d_model,
        activation="gelu",
        norm="layer",
        tied=bool(hf.get("tie_word_embeddings", True)),
        rotary=False,
        learned_positions=True,
        max_seq_len=_need(hf, "n_positions"),
        use_bias=True,
        fused_qkv=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def config_from_hf(hf: dict[str, Any]) -> tuple[GPTConfig, str]:
    """The `GPTConfig` of a Hugging Face config dict, and its `model_type`."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise _refuse(
            "model_type",
            kind,
            f"model_type in {ARCHITECTURES}",
            "Other architectures have layers eqxpar's GPT does not have.",
        )
    try:
        return (_gpt2(hf) if kind == "gpt2" else _llama_like(hf, kind)), kind
    except PretrainedError:
        raise
    except Exception as e:  # GPTConfig's own checks: name them as config.json's problem
        raise PretrainedError(f"from_pretrained: config.json describes no valid eqxpar GPT: {e}") from e


def infer_model_type(config: GPTConfig) -> str:
    """The Hugging Face architecture a `GPTConfig` is written as (see `config_to_hf`)."""
    if config.learned_positions:
        return "gpt2"
    if config.moe_every:
        return "mixtral"
    if config.qkv_bias and not config.use_bias:
        return "qwen2"
    return "llama"


def _check(config: GPTConfig, kind: str, wanted: dict[str, Any]) -> None:
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise PretrainedError(
                f"save_pretrained: GPTConfig({field}={getattr(config, field)!r}) cannot be written as "
                f"Hugging Face {kind!r}, which needs {field}={value!r}. Save a model whose config has "
                "it, or keep eqxpar's own checkpoints (eqxpar.checkpoint) for this one."
            )


def config_to_hf(config: GPTConfig, kind: str, dtype_name: str) -> dict[str, Any]:
    """The Hugging Face config dict of `config` written as architecture `kind`."""
    if kind not in ARCHITECTURES:
        raise PretrainedError(f"save_pretrained(model_type={kind!r}): expected one of {ARCHITECTURES}.")
    head = {"architectures": [_CLASSES[kind]], "model_type": kind, "torch_dtype": dtype_name}
    if kind == "gpt2":
        return {**head, **_gpt2_fields(config)}
    return {**head, **_llama_family_fields(config, kind)}


def _gpt2_fields(c: GPTConfig) -> dict[str, Any]:
    _check(
        c,
        "gpt2",
        dict(
            activation="gelu",
            norm="layer",
            rotary=False,
            learned_positions=True,
            use_bias=True,
            fused_qkv=True,
            qkv_bias=None,
            moe_every=0,
        ),
    )
    return {
        "vocab_size": c.vocab_size,
        "n_embd": c.d_model,
        "n_head": c.num_heads,
        "n_layer": c.num_layers,
        "n_inner": c.d_hidden,
        "n_positions": c.max_seq_len,
        "layer_norm_epsilon": 1e-5 if c.norm_eps is None else c.norm_eps,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": c.tied,
    }


def _llama_family_fields(c: GPTConfig, kind: str) -> dict[str, Any]:
    """Llama, Mistral, Qwen2 and Mixtral: one layout, each with its own checks."""
    _check(
        c, kind, dict(activation="swiglu", norm="rms", rotary=True, learned_positions=False, fused_qkv=False)
    )
    _check(c, kind, dict(moe_every=1 if kind == "mixtral" else 0))
    if kind == "qwen2":
        _check(c, kind, dict(use_bias=False, qkv_bias=True))
    elif c.qkv_bias is not None:
        _check(c, kind, dict(qkv_bias=c.use_bias))
    if kind in ("mistral", "mixtral"):
        _check(c, kind, dict(use_bias=False))
    out = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_hidden,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads or c.num_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": 1e-6 if c.norm_eps is None else c.norm_eps,
        "rope_theta": c.rotary_base,
        "tie_word_embeddings": c.tied,
        "attention_dropout": 0.0,
        "rope_scaling": _rope_scaling_fields(c.rotary_scaling),
    }
    if kind == "llama":
        out.update(attention_bias=c.use_bias, mlp_bias=c.use_bias)
    if kind in ("mistral", "mixtral", "qwen2"):
        out.update(sliding_window=None, use_sliding_window=False)
    if kind == "mixtral":
        _check(c, kind, dict(num_shared_experts=0, capacity_factor=None, moe_score="softmax"))
        out.update(
            num_local_experts=c.experts,
            num_experts_per_tok=c.top_k,
            router_aux_loss_coef=c.load_balance_coef,
            output_router_logits=c.load_balance_coef > 0,
            router_jitter_noise=0.0,
        )
    return out


def _rope_scaling_fields(s: Any) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_positions,
    }
