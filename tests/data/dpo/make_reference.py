"""Make the reference tests/test_dpo.py reads: TRL's DPO loss on a tiny model.

The policy is the tiny Llama checkpoint of tests/data/pretrained/llama with the
PEFT adapter of tests/data/lora/llama (what `tests._helpers.lora_reference_model
("llama")` builds in eqxpar and `eqxpar.models.save_lora` wrote); the reference
is the same model with its adapter switched off, as `trl.DPOTrainer` takes it
when given a PEFT model and no `ref_model`. For each of TRL's loss types
`sigmoid`, `ipo` and `hinge` (beta 0.1), `DPOTrainer._compute_loss` runs on a
fixed batch of preference pairs (prompt + completion, right-padded; the
completion mask as TRL's collator gives it) and this script writes to
`reference.npz`:

- `chosen`, `rejected`: the pairs' token ids, `(pairs, length)`;
- `chosen_mask`, `rejected_mask`: TRL's completion masks, `(pairs, length)`
  (1 on completion tokens, 0 on the prompt and the padding);
- `logps/{policy,reference}_{chosen,rejected}`: the per-sequence log-prob sums
  over the completion that TRL's fused head computes, `(pairs,)`;
- `<loss_type>/loss`, `<loss_type>/chosen_rewards`, `<loss_type>/rejected_rewards`:
  the loss (the mean over pairs) and TRL's rewards, `beta * (policy - reference)`;
- `<loss_type>/grad/<PEFT tensor name>`: the loss's gradient w.r.t. each adapter
  tensor, named and shaped as in `adapter_model.safetensors`.

Needs torch, transformers, peft and trl (tests do not):

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers peft trl
    /tmp/hf/bin/python tests/data/dpo/make_reference.py

Made with torch 2.13.0 (CPU), transformers 5.25.0, peft 0.21.2 and trl 1.16.0.
"""

import contextlib
import pathlib
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from trl import DPOTrainer
from trl.trainer.utils import add_fused_lm_head

HERE = pathlib.Path(__file__).parent
DATA = HERE.parent
BETA = 0.1
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
# Per pair: prompt length, chosen and rejected completion lengths (the rest padding).
LENGTHS = ((3, 5, 4), (2, 7, 7), (4, 3, 6), (5, 6, 2))
LENGTH = 13
VOCAB = 64


def batch() -> dict[str, np.ndarray]:
    """Pairs sharing a prompt, right-padded with token 0 to `LENGTH`."""
    rng = np.random.default_rng(0)
    out = {name: np.zeros((len(LENGTHS), LENGTH), np.int64) for name in ("chosen", "rejected")}
    masks = {name: np.zeros((len(LENGTHS), LENGTH), np.int64) for name in ("chosen", "rejected")}
    for i, (prompt, *completions) in enumerate(LENGTHS):
        ids = rng.integers(3, VOCAB, prompt)
        for name, n in zip(("chosen", "rejected"), completions, strict=True):
            out[name][i, :prompt] = ids
            out[name][i, prompt : prompt + n] = rng.integers(3, VOCAB, n)
            masks[name][i, prompt : prompt + n] = 1
    return {**out, "chosen_mask": masks["chosen"], "rejected_mask": masks["rejected"]}


class _Accelerator:
    """The parts of `accelerate.Accelerator` `_compute_loss` calls, on one CPU process."""

    device = torch.device("cpu")

    def unwrap_model(self, model):
        return model

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def autocast(self):
        return contextlib.nullcontext()


def policy() -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(DATA / "pretrained" / "llama", dtype=torch.float32)
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    model = PeftModel.from_pretrained(base, DATA / "lora" / "llama", is_trainable=True)
    model.train()  # no dropout in the checkpoint or the adapter: train mode computes what eval does
    return model


def trainer(model: PeftModel, loss_type: str) -> DPOTrainer:
    """A `DPOTrainer` holding what `_compute_loss` reads, as its `__init__` sets it
    for `DPOConfig(beta=BETA, loss_type=[loss_type])` and a PEFT model without
    `ref_model` (the reference: the adapter switched off)."""
    t = DPOTrainer.__new__(DPOTrainer)
    t.model, t.ref_model, t.accelerator = model, None, _Accelerator()
    t.args = SimpleNamespace(gradient_checkpointing_kwargs=None)
    t.beta, t.loss_types, t.loss_weights = BETA, [loss_type], [1.0]
    t.ld_alpha, t.f_divergence_type, t.label_smoothing = None, "reverse_kl", 0.0
    t.precompute_ref_logps, t.use_weighting, t.aux_loss_enabled = False, False, False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._total_train_tokens, t._tp_size = 0, 1
    return t


def sequence_logps(model, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
    return out.log_probs.sum(dim=1).numpy()


def main() -> None:
    pairs = batch()
    ids = torch.from_numpy(np.concatenate([pairs["chosen"], pairs["rejected"]]))
    mask = torch.from_numpy(np.concatenate([pairs["chosen_mask"], pairs["rejected_mask"]]))
    # TRL's collator: attention on every real token (prompt + completion), none on padding.
    attention = (ids != 0).long()
    attention[:, 0] = 1
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": mask}
    out: dict[str, np.ndarray] = dict(pairs)
    model = policy()
    n = len(LENGTHS)
    logps = sequence_logps(model, ids, mask)
    with model.disable_adapter():
        ref = sequence_logps(model, ids, mask)
    out["logps/policy_chosen"], out["logps/policy_rejected"] = logps[:n], logps[n:]
    out["logps/reference_chosen"], out["logps/reference_rejected"] = ref[:n], ref[n:]
    for loss_type in LOSS_TYPES:
        model.zero_grad()
        t = trainer(model, loss_type)
        loss = t._compute_loss(model, inputs, return_outputs=False)
        loss.backward()
        metrics = t._metrics["train"]
        out[f"{loss_type}/loss"] = loss.detach().numpy()
        # TRL logs the rewards' means; the per-pair rewards are beta * (policy - reference).
        out[f"{loss_type}/rewards_chosen_mean"] = np.asarray(metrics["rewards/chosen"][-1])
        out[f"{loss_type}/rewards_rejected_mean"] = np.asarray(metrics["rewards/rejected"][-1])
        out[f"{loss_type}/reward_accuracy"] = np.asarray(metrics["rewards/accuracies"][-1])
        out[f"{loss_type}/reward_margin"] = np.asarray(metrics["rewards/margins"][-1])
        for name, p in model.named_parameters():
            if p.grad is not None:
                out[f"{loss_type}/grad/{name.replace('.default', '')}"] = p.grad.numpy().copy()
        print(loss_type, float(loss), out[f"{loss_type}/reward_accuracy"])
    np.savez_compressed(HERE / "reference.npz", **out)
    print("wrote", HERE / "reference.npz", len(out), "arrays")


if __name__ == "__main__":
    main()
