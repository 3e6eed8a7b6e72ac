"""`save_lora`: a GPT's adapters written as a PEFT LoRA adapter directory
(`adapter_config.json` + `adapter_model.safetensors`) for the Hugging Face base
model `save_pretrained` writes."""

import json
import math
import os
import pathlib
from typing import Any

import jax
import numpy as np

from .. import nn
from .._errors import PretrainedError
from .._stack_order import in_natural_order
from ._gpt import GPT
from ._hf_config import config_to_hf, infer_model_type
from ._hf_files import safetensors_module, write_safetensors
from ._pretrained import host_array

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# eqxpar's (layer, projection) -> the Hugging Face module PEFT adapts, per layout.
_LLAMA = {
    ("attn", "q"): "self_attn.q_proj",
    ("attn", "k"): "self_attn.k_proj",
    ("attn", "v"): "self_attn.v_proj",
    ("attn", "o"): "self_attn.o_proj",
    ("mlp", "gate"): "mlp.gate_proj",
    ("mlp", "up"): "mlp.up_proj",
    ("mlp", "down"): "mlp.down_proj",
}
# GPT-2's attention output and MLP output are both `c_proj`: PEFT matches a
# target as a suffix after a dot, so `attn.c_proj` names only the first.
_GPT2 = {
    ("attn", "qkv"): "attn.c_attn",
    ("attn", "o"): "attn.c_proj",
    ("mlp", "up"): "mlp.c_fc",
    ("mlp", "down"): "mlp.c_proj",
}


def _adapters(model: GPT) -> list[tuple[str, Any]]:
    """`(layer, adapter)` of the model's stack: `("attn", AttentionLoRA)`, `("mlp",
    MLPLoRA)`, row `i` of each adapter leaf being layer `i`. An MoE model reaches
    here only in Mixtral's layout (`moe_every=1`: `_check_base` refuses the others),
    one MoE block per row, whose experts take no adapters."""
    blocks = model.blocks.blocks
    if model.config.moe_every:
        blocks = blocks.moe
    out = [("attn", blocks.attn.lora)]
    if isinstance(blocks.mlp, nn.MLP):
        out.append(("mlp", blocks.mlp.lora))
    return [(layer, lora) for layer, lora in out if lora is not None]


def _tensors(model: GPT, kind: str) -> tuple[dict[str, Any], list[str], Any]:
    """PEFT's tensor names -> (eqxpar leaf, layer index, "A"/"B", input dims), the
    target modules and one adapter (for its rank and alpha)."""
    names = _GPT2 if kind == "gpt2" else _LLAMA
    prefix = "base_model.model.transformer.h" if kind == "gpt2" else "base_model.model.model.layers"
    tensors: dict[str, Any] = {}
    targets: set[str] = set()
    adapters = _adapters(model)
    if not adapters:
        raise PretrainedError(
            "save_lora: the model has no adapters. Add them with eqxpar.models.add_lora (and train them) first."
        )
    for layer, lora in adapters:
        for field in lora.__dataclass_fields__:
            if not field.endswith("_a") or getattr(lora, field) is None:
                continue
            proj = field[:-2]
            module = names.get((layer, proj))
            if module is None:
                raise PretrainedError(
                    f"save_lora: Hugging Face {kind!r} has no module for eqxpar's {layer}.{proj} adapter. "
                    f"Adapt only {sorted(p for _, p in names)}."
                )
            targets.add(module)
            a, b = getattr(lora, f"{proj}_a"), getattr(lora, f"{proj}_b")
            for i in range(a.shape[0]):
                base = f"{prefix}.{i}.{module}"
                tensors[f"{base}.lora_A.weight"] = (a, i, "A")
                tensors[f"{base}.lora_B.weight"] = (b, i, "B")
    return tensors, sorted(targets), adapters[0][1]


def _check_base(config: Any, kind: str) -> None:
    """Refuse adapters whose base `save_pretrained` cannot write: PEFT names the
    modules of that Hugging Face model, layer by layer. (An MoE model with dense
    blocks between its MoE blocks, `moe_every > 1`, is Qwen2-MoE's layout in
    Hugging Face, whose shared experts carry a sigmoid gate eqxpar's lack.)"""
    try:
        config_to_hf(config, kind, "float32")
    except PretrainedError as e:
        raise PretrainedError(
            f"save_lora: a PEFT adapter names the modules of its Hugging Face base model, and this "
            f"model cannot be written as one. {e}"
        ) from e


def _peft_tensor(leaf: np.ndarray, part: str) -> np.ndarray:
    # eqxpar: A (*in, rank), B (rank, *out); PEFT (torch Linear): A (rank, in), B (out, rank).
    if part == "A":
        return np.ascontiguousarray(leaf.reshape(-1, leaf.shape[-1]).T)
    return np.ascontiguousarray(leaf.reshape(leaf.shape[0], -1).T)


def _peft_shape(shape: tuple[int, ...], part: str) -> tuple[int, int]:
    # A (*in, rank) -> (rank, in); B (rank, *out) -> (out, rank).
    if part == "A":
        return shape[-1], math.prod(shape[:-1])
    return math.prod(shape[1:]), shape[0]


def save_lora(model: GPT, path: str | os.PathLike, *, base_model: str | None = None) -> None:
    """Write the adapters of `model` (from `add_lora`) as a PEFT LoRA adapter
    directory: `adapter_config.json` and `adapter_model.safetensors`, which the
    `peft` package loads onto the transformers model of the base checkpoint
    (`PeftModel.from_pretrained(base, path)`) to compute the logits `model`
    computes.

    Each eqxpar projection is one PEFT target: Llama-style models' `q_proj`,
    `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`; GPT-2's
    fused `c_attn` (target `"qkv"`), `attn.c_proj` (`"o"`), `c_fc` (`"up"`) and
    `mlp.c_proj` (`"down"`), with `fan_in_fan_out` set for its Conv1D weights;
    `lora_dropout` is the adapters' `dropout`.
    The model may be sharded under any plan: each adapter is gathered to the
    hosts on its own, and process 0 writes (every process must call this).

    **Arguments:**

    - `model`: an `eqxpar.models.GPT` with adapters.
    - `path`: the directory to write (created if missing).
    - `base_model`: written as `base_model_name_or_path` (keyword-only; default None).

    **Returns:** None.

    ```python
    eqxpar.models.save_lora(state.model, "adapter", base_model="meta-llama/Llama-3.2-1B")
    ```
    """
    if not isinstance(model, GPT):
        raise PretrainedError(f"save_lora(model={type(model).__name__}): expected an eqxpar.models.GPT.")
    safetensors_module()
    model = in_natural_order(model)
    kind = infer_model_type(model.config)
    _check_base(model.config, kind)
    tensors, targets, first = _tensors(model, kind)
    # Adapters are small: each is gathered once, whole, and kept for its layers.
    hosts: dict[int, np.ndarray] = {}

    def fetch(name: str) -> np.ndarray:
        leaf, i, part = tensors[name]
        if id(leaf) not in hosts:
            hosts[id(leaf)] = host_array(leaf)
        return _peft_tensor(hosts[id(leaf)][i], part)

    shapes = {name: _peft_shape(leaf.shape[1:], part) for name, (leaf, _, part) in tensors.items()}
    directory = pathlib.Path(path)
    if jax.process_index() != 0:
        for name in tensors:  # the gathers are collective: take part in each
            fetch(name)
        return
    directory.mkdir(parents=True, exist_ok=True)
    alpha = first.alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": first.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": first.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": kind == "gpt2",
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    specs = [(name, shapes[name], np.dtype(tensors[name][0].dtype)) for name in tensors]
    write_safetensors(directory / WEIGHTS, specs, fetch)
