"""Make the tiny reference checkpoints that tests/test_pretrained.py reads.

For each architecture eqxpar.models.from_pretrained supports, this builds a tiny
randomly initialised model with transformers, writes it with transformers'
own `save_pretrained` (config.json + model.safetensors) into
`tests/data/pretrained/<name>/`, and stores in `<name>/reference.npz` a fixed
token batch (`tokens`, int32 `(4, 9)`) and the logits transformers computes for
it (`logits`, float32 `(4, 9, vocab)`). The test checks eqxpar's logits against
these, so eqxpar's parity is pinned to transformers without torch in CI.

Needs torch and transformers (not eqxpar's dependencies; CI never runs it):

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors numpy
    /tmp/hf/bin/python tests/data/pretrained/make_references.py

Made with torch 2.13.0 (CPU) and transformers 5.24.0; rerun it only to change the
references (the test's expectations move with them).
"""

import pathlib
import shutil

import numpy as np
import torch
import transformers as tf

HERE = pathlib.Path(__file__).parent
VOCAB = 64
# Shared by the Llama-shaped models: grouped-query attention (4 query heads, 2 kv).
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
CONFIGS = {
    # Llama 2: RMSNorm eps 1e-5, untied head.
    "llama": tf.LlamaConfig(**SMALL, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Llama 3.1's rope scaling, with an original context short enough (16) that
    # it moves frequencies of this tiny head_dim: some kept, some blended, some divided.
    "llama3_rope": tf.LlamaConfig(
        **SMALL,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral": tf.MistralConfig(**SMALL, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
    # Qwen2: biases on Q, K and V only; eps 1e-6; tied embeddings.
    "qwen2": tf.Qwen2Config(**SMALL, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0),
    "mixtral": tf.MixtralConfig(
        **{**SMALL, "intermediate_size": 32},
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # GPT-2: learned positions, fused c_attn, Conv1D (in, out) weights, gelu_new, tied head.
    "gpt2": tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=32, n_inner=64),
}


def main() -> None:
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(4, 9)).astype(np.int32)
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            # Larger than the default init (std 0.02), so every weight moves the
            # logits well above float32 noise; norm scales near 1, biases nonzero.
            for pname, p in model.named_parameters():
                if "norm" in pname or "ln_" in pname:
                    p.copy_(
                        1.0 + 0.1 * torch.randn_like(p)
                        if pname.endswith("weight")
                        else 0.1 * torch.randn_like(p)
                    )
                else:
                    p.copy_(
                        0.3 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5
                    )
            logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, safe_serialization=True)
        for extra in out.glob("generation_config.json"):
            extra.unlink()
        np.savez(out / "reference.npz", tokens=tokens, logits=logits)
        print(name, sorted(p.name for p in out.iterdir()), logits.std())


if __name__ == "__main__":
    main()
