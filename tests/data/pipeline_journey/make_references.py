"""Make the references tests/test_pipeline_journeys.py reads.

1. `base`: a tiny randomly initialised 8-layer Llama that transformers writes with
   its own `save_pretrained` (config.json + model.safetensors, in `base/`).
2. `train`: for every plan of `tests._helpers.PIPELINE_JOURNEYS` (each pipeline
   schedule, with equal and with uneven stages), eqxpar reads `base/` into the
   plan, trains one AdamW step and writes the model with
   `eqxpar.models.save_pretrained` into a scratch directory.
3. `read`: transformers' `AutoModelForCausalLM` reads each of those checkpoints
   and computes its logits on `journey_tokens()`; they go into `trained.npz`, one
   entry per plan. The test trains the same way, saves, and checks that eqxpar's
   logits of what it wrote equal what transformers read from the same file.

Steps 1 and 3 need torch and transformers, step 2 eqxpar (CI runs none of them):

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors numpy
    /tmp/hf/bin/python tests/data/pipeline_journey/make_references.py base
    .venv/bin/python tests/data/pipeline_journey/make_references.py train /tmp/journeys
    /tmp/hf/bin/python tests/data/pipeline_journey/make_references.py read /tmp/journeys

Made with torch 2.13.0 (CPU), transformers 5.24.0 and eqxpar at the commit that
added it.
"""

import os
import pathlib
import shutil
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[2]


def base() -> None:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        # Larger than the default init, so that every layer moves the logits well
        # above float32 noise (a permuted layer order shows at once).
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    out = HERE / "base"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    for extra in out.glob("generation_config.json"):
        extra.unlink()


def train(scratch: pathlib.Path) -> None:
    # Before jax starts: 8 CPU devices, and collectives run one at a time (as the tests do).
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
    sys.path.insert(0, str(ROOT))
    import eqxpar
    import tests._helpers as H

    for name in H.PIPELINE_JOURNEYS:
        state, loss = H.journey_train(H.journey_plan(name))
        eqxpar.models.save_pretrained(state.model, scratch / name)
        print(name, loss)


def read(scratch: pathlib.Path) -> None:
    import torch
    import transformers as tf

    tokens = np.random.default_rng(1).integers(0, 64, size=(8, 9)).astype(np.int32)  # journey_tokens()
    logits = {}
    for directory in sorted(scratch.iterdir()):
        model = tf.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits[directory.name] = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.savez(HERE / "trained.npz", tokens=tokens, **logits)
    print(sorted(logits))


if __name__ == "__main__":
    {
        "base": lambda: base(),
        "train": lambda: train(pathlib.Path(sys.argv[2])),
        "read": lambda: read(pathlib.Path(sys.argv[2])),
    }[sys.argv[1]]()
