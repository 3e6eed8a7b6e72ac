"""The memory of token log-probabilities at 32,768 tokens and Qwen's 151,936-word
vocabulary under tensor=4 (BENCHMARKS.md, "Token log-probabilities"): the
compiled temporaries of a step that differentiates `eqxpar.models.token_logprobs`,
chunked and whole, compiled from shapes for a 4-chip TPU slice.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -m benchmarks.logprobs_memory \\
        --json benchmarks/results/quick.json --markdown BENCHMARKS.md

Three steps of one model under one plan, each SGD on a loss of the model: the
mean log-probability unchunked (`chunk=None`), the same chunked, and the model
without its head (the mean of the final norm's output), whose temporaries are
everything but the head's. The record states the bound the chunked step meets:
its temporaries above the headless step's are a few chunk-sized float32 logits
(`chunk x vocab / 4 x 4` bytes per device: the head is vocabulary-parallel),
where the unchunked step's are a few whole-sequence ones.
"""

import argparse
import json
import os
import pathlib
import sys
import time

#: Qwen2's vocabulary; 32,768 tokens (one row); the tensor axis.
VOCAB, TOKENS, TENSOR = 151_936, 32_768, 4
TOPOLOGY, CHUNK = "v5p-8", 1024
#: The model around the head: one block, so the head dominates.
MODEL = dict(d_model=1024, num_heads=8, num_layers=1, d_hidden=2048, tied=False)
BEGIN = (
    "<!-- logprobs memory table (python -m benchmarks.logprobs_memory --markdown): "
    "edit the prose outside it -->"
)
END = "<!-- end of logprobs memory table -->"
#: The bound, checked: chunked temporaries above the headless step's, in chunks of logits.
CHUNKS_BOUND = 4


def _compile(loss, config, plan) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqxpar

    outline = eqx.filter_eval_shape(eqxpar.models.GPT, config, key=jax.random.key(0))
    optimizer = optax.sgd(1e-3)
    state = eqxpar.train.init(outline, optimizer, plan, key=jax.random.key(0), abstract=True)
    tokens = jax.ShapeDtypeStruct((1, TOKENS + 1), jnp.int32)
    start = time.perf_counter()
    compiled = eqxpar.train.make_step(loss, optimizer, plan).lower(state, tokens).compile()
    memory = compiled.memory_analysis()
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "compile_seconds": round(time.perf_counter() - start, 1),
    }


def measure() -> dict:
    """Compile the three steps; the record."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp

    import eqxpar

    config = eqxpar.models.GPTConfig(vocab_size=VOCAB, max_seq_len=TOKENS, **MODEL)
    mesh = eqxpar.make_mesh(tensor=TENSOR, topology=TOPOLOGY)
    plan = eqxpar.Plan(mesh, rules=eqxpar.rules.MEGATRON, remat="full", compute_dtype=jnp.bfloat16)

    def logprobs_loss(chunk):
        return lambda m, t: -jnp.mean(eqxpar.models.token_logprobs(m, t, chunk=chunk))

    def headless(m, t):
        return jnp.mean(m.final_norm(m.blocks(m.embed_tokens(t[:, :-1]))).astype(jnp.float32))

    steps = {"whole": logprobs_loss(None), "chunked": logprobs_loss(CHUNK), "headless": headless}
    figures = {name: _compile(loss, config, plan) for name, loss in steps.items()}
    chunk_logits = CHUNK * VOCAB // TENSOR * 4
    whole_logits = TOKENS * VOCAB // TENSOR * 4
    rest = figures["headless"]["temp_bytes"]
    record = {
        "command": "python -m " + " ".join(["benchmarks.logprobs_memory", *sys.argv[1:]]),
        "topology": TOPOLOGY,
        "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": {"tensor": TENSOR},
        "plan": "MEGATRON (vocabulary split over tensor), automatic, remat full, bfloat16 compute",
        "model": {"vocab_size": VOCAB, **MODEL},
        "tokens": TOKENS,
        "chunk": CHUNK,
        "chunk_logits_bytes": chunk_logits,
        "whole_logits_bytes": whole_logits,
        **figures,
        "above_headless_in_chunk_logits": (figures["chunked"]["temp_bytes"] - rest) / chunk_logits,
        "above_headless_in_whole_logits": (figures["whole"]["temp_bytes"] - rest) / whole_logits,
        "bound": (
            f"chunked temp <= headless temp + {CHUNKS_BOUND} x chunk x vocab / {TENSOR} x 4 B "
            f"({CHUNKS_BOUND} x {chunk_logits / 2**20:.0f} MiB)"
        ),
        "versions": {"jax": jax.__version__},
    }
    record["bound_met"] = record["above_headless_in_chunk_logits"] <= CHUNKS_BOUND
    return record


def table(record: dict) -> str:
    """The Markdown table of a `logprobs_memory` record."""
    from . import report

    mib = lambda x: f"{x / 2**20:,.0f} MiB"  # noqa: E731
    rest = record["headless"]["temp_bytes"]
    rows = []
    sides = (("whole", "unchunked"), ("chunked", f"chunk={record['chunk']}"), ("headless", "no head"))
    for name, what in sides:
        temp = record[name]["temp_bytes"]
        above = mib(temp - rest) if name != "headless" else ""
        rows.append([what, mib(temp), above, f"{record[name]['compile_seconds']} s"])
    columns = ["log-probs step", "temporaries per chip", "above the headless step", "compile"]
    return report.markdown_table(columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True, help="the JSON to record into")
    parser.add_argument("--markdown", type=pathlib.Path, help="a page with the table's markers")
    args = parser.parse_args()
    from . import _measure, report

    record = measure()
    print(json.dumps(record, indent=1))
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    _measure.write_json(args.json, {**data, "logprobs_memory": record})
    if args.markdown:
        report.splice(args.markdown, table(record), begin=BEGIN, end=END)
    if not record["bound_met"]:
        sys.exit(f"the chunked step breaks its bound: {record['bound']}")


if __name__ == "__main__":
    main()
