"""Make the greedy-generation references that tests/test_generate.py reads.

For the tiny checkpoints make_references.py wrote (Llama 3.1 with rope scaling,
Qwen2, Mixtral, GPT-2), this runs transformers' `generate(do_sample=False)` on a
left-padded batch built from `reference.npz`'s tokens and stores in
`<name>/generation.npz`:

- `prompt`: int32 `(4, 9)`, each row's prompt right-aligned, `PAD` to its left;
- `lengths`: int32 `(4,)`, the real prompt tokens per row;
- `tokens`: int32 `(4, STEPS)`, the tokens transformers generated;
- `logprobs`: float32 `(4, STEPS)`, log-softmax of transformers' raw logits at
  the chosen tokens;
- `margins`: float32 `(4,)`, the smallest gap between the largest and second
  largest logit along each row's generated tokens (tiny random models have
  near-ties: a margin near float32 noise would make a token-for-token comparison
  meaningless, so the test prints and checks them).

Like with like: transformers gets an explicit attention mask (it would otherwise
mask every prompt token equal to `pad_token_id`), and its generation config's
`eos_token_id` is cleared, so it generates exactly `STEPS` tokens without
`min_new_tokens` (which forbids the end-of-sequence id). Each padded row is also
generated alone, unpadded, and must give the same tokens: transformers then reads
positions from the mask, as eqxpar does from the prompt lengths.

Needs torch and transformers (see make_references.py; CI never runs it):

    /tmp/hf/bin/python tests/data/pretrained/make_generation_references.py

Made with torch 2.13.0 (CPU) and transformers 5.24.0.
"""

import pathlib

import numpy as np
import torch
import transformers as tf

HERE = pathlib.Path(__file__).parent
NAMES = ["llama3_rope", "qwen2", "mixtral", "gpt2"]
STEPS = 12
LENGTHS = np.array([9, 5, 9, 3], np.int32)
PAD = 0


def greedy(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=STEPS,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, ids.shape[1] :].numpy().astype(np.int32)
    logits = torch.stack(out.logits, dim=1).float().numpy()  # (batch, STEPS, vocab)
    return new, logits


def main() -> None:
    for name in NAMES:
        model = tf.AutoModelForCausalLM.from_pretrained(HERE / name, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        tokens = np.load(HERE / name / "reference.npz")["tokens"]
        width = tokens.shape[1]
        prompt = np.full_like(tokens, PAD)
        mask = np.zeros_like(tokens)
        for row, n in enumerate(LENGTHS):
            prompt[row, width - n :] = tokens[row, :n]
            mask[row, width - n :] = 1
        with torch.no_grad():
            new, logits = greedy(model, torch.from_numpy(prompt).long(), torch.from_numpy(mask).long())
            for row, n in enumerate(LENGTHS):
                alone = torch.from_numpy(tokens[row : row + 1, :n]).long()
                single, _ = greedy(model, alone, torch.ones_like(alone))
                assert (single[0] == new[row]).all(), (name, row, single[0], new[row])
        assert len(new[0]) == STEPS, new.shape
        logprobs = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()
        chosen = np.take_along_axis(logprobs, new[:, :, None], axis=2)[:, :, 0]
        top2 = np.sort(logits, axis=-1)[:, :, -2:]
        margins = (top2[:, :, 1] - top2[:, :, 0]).min(axis=1)
        np.savez(
            HERE / name / "generation.npz",
            prompt=prompt.astype(np.int32),
            lengths=LENGTHS,
            tokens=new,
            logprobs=chosen.astype(np.float32),
            margins=margins.astype(np.float32),
        )
        print(name, "margins", np.round(margins, 4), "tokens", new.tolist())


if __name__ == "__main__":
    main()
