"""Make the references tests/test_lora.py reads.

For each of `tests._helpers.LORA_TARGETS` (`llama`: separate q, k, v, o, gate,
up, down; `gpt2`: the fused `c_attn`, `attn.c_proj`, `c_fc`, `mlp.c_proj`;
`mixtral`: q, k, v, o of every layer, each an MoE block), or only the names
given after the step:

1. `write` (eqxpar): `tests._helpers.lora_reference_model(name)`, the tiny
   checkpoint of tests/data/pretrained/<name> with adapters from fixed keys, is
   written twice into `<name>/`: its adapters with `eqxpar.models.save_lora`
   (`adapter_config.json` + `adapter_model.safetensors`, PEFT's format) and the
   merged model (`eqxpar.models.merge_lora`) with
   `eqxpar.models.save_pretrained` (`merged/`).
2. `read` (torch): transformers reads tests/data/pretrained/<name>, `peft`
   puts the adapter of step 1 on it (`PeftModel.from_pretrained`), and both its
   logits and those of transformers reading `merged/` on the pretrained
   references' tokens go into `<name>/reference.npz` (`tokens`, `peft_logits`,
   `merged_logits`).

The test rebuilds the model from the same keys, checks that save_lora and
save_pretrained write what is committed, and that eqxpar's logits, adapted and
merged, equal what peft and transformers computed from those files.

Step 1 needs eqxpar, step 2 torch, transformers and peft (CI runs neither):

    /tmp/hf/bin/pip install peft
    .venv/bin/python tests/data/lora/make_references.py write [NAME ...]
    /tmp/hf/bin/python tests/data/lora/make_references.py read [NAME ...]

Made with torch 2.13.0 (CPU), transformers 5.24.0 and peft 0.21.2 (`mixtral`
added later, alone: `write mixtral`, `read mixtral`, with the same versions;
reading the others again moves their logits by float noise, ~2e-6, so name
only the checkpoints to add).
"""

import os
import pathlib
import shutil
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[2]
NAMES = ("llama", "gpt2", "mixtral")


def write(names: tuple[str, ...]) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, str(ROOT))
    import eqxpar
    import tests._helpers as H

    for name in names:
        model = H.lora_reference_model(name)
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        eqxpar.models.save_lora(model, out)
        eqxpar.models.save_pretrained(eqxpar.models.merge_lora(model), out / "merged")
        print(name, sorted(p.name for p in out.iterdir()))


def read(names: tuple[str, ...]) -> None:
    import peft
    import torch
    import transformers as tf

    for name in names:
        ref = np.load(HERE.parent / "pretrained" / name / "reference.npz")
        tokens = torch.from_numpy(ref["tokens"]).long()
        base = tf.AutoModelForCausalLM.from_pretrained(HERE.parent / "pretrained" / name, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base, HERE / name).eval()
        merged = tf.AutoModelForCausalLM.from_pretrained(HERE / name / "merged", dtype=torch.float32).eval()
        with torch.no_grad():
            peft_logits = adapted(tokens).logits.float().numpy()
            merged_logits = merged(tokens).logits.float().numpy()
        np.savez(
            HERE / name / "reference.npz",
            tokens=ref["tokens"],
            peft_logits=peft_logits,
            merged_logits=merged_logits,
        )
        print(
            name,
            float(np.abs(peft_logits - ref["logits"]).max()),
            float(np.abs(peft_logits - merged_logits).max()),
        )


if __name__ == "__main__":
    {"write": write, "read": read}[sys.argv[1]](tuple(sys.argv[2:]) or NAMES)
