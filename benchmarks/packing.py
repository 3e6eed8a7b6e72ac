"""Packing documents into rows (`eqxpar.data.PackedTokens`): how full each option
fills the rows, how long building takes, and how fast packed rows are read.

A token file of documents whose lengths are log-normal (median about 400 ids, a
twentieth longer than a 2,049-id row, as web text tokenized with GPT-2's vocabulary
roughly is) is written to a temporary directory and packed under each option;
`ShardedIterator` then reads global batches of packed rows beside the same file's
unpacked sequences.

    python -m benchmarks.packing --documents 200000 [--json results/packing.json]
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np

import eqxpar
import eqxpar.data

OPTIONS = (
    {},
    {"open_rows": 8},
    {"open_rows": 64},
    {"split": "always"},
    {"split": "never"},
)


def write_documents(path: str, documents: int, *, seed: int = 0) -> int:
    """Write `documents` documents of random ids, each ended by id 0, as raw uint16; the id count."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(mean=6.0, sigma=1.0, size=documents).astype(np.int64))
    ids = rng.integers(1, 50_000, size=int(lengths.sum()), dtype=np.uint16)
    ids[np.cumsum(lengths) - 1] = 0
    ids.tofile(path)
    return int(ids.shape[0])


def _read_ms(data, plan, steps: int) -> float:
    it = eqxpar.data.ShardedIterator(data, plan, batch_size=64, seed=0)
    next(it)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    return (time.perf_counter() - start) / steps * 1e3


def measure(documents: int, *, seq_len: int = 2048, steps: int = 50) -> dict:
    """Rows, fill and build seconds of each option in `OPTIONS`, and read times per batch of 64."""
    path = os.path.join(tempfile.mkdtemp(), "documents.bin")
    ids = write_documents(path, documents)
    tokens = eqxpar.data.TokenFile(path, seq_len=seq_len, dtype=np.uint16)
    records = []
    for options in OPTIONS:
        start = time.perf_counter()
        packed = eqxpar.data.PackedTokens(tokens, eod_id=0, **options)
        seconds = time.perf_counter() - start
        records.append({"options": options, "rows": len(packed), "fill": packed.fill, "build_s": seconds})
    plan = eqxpar.Plan(eqxpar.make_mesh(data=-1))  # every device: one process reads the whole batch
    packed = eqxpar.data.PackedTokens(tokens, eod_id=0, open_rows=8)
    return {
        "documents": documents,
        "ids": ids,
        "seq_len": seq_len,
        "options": records,
        "read_ms_per_batch_of_64": {
            "packed": _read_ms(packed, plan, steps),
            "sequences": _read_ms(tokens, plan, steps),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    result = measure(args.documents)
    print(f"{result['documents']} documents, {result['ids']:,} ids, rows of {result['seq_len'] + 1}")
    for r in result["options"]:
        options = json.dumps(r["options"])
        print(f"  {options:24s} {r['rows']:8d} rows  fill {r['fill']:.3f}  built in {r['build_s']:.2f} s")
    reads = result["read_ms_per_batch_of_64"]
    print(f"  a batch of 64 rows: {reads['packed']:.1f} ms packed, {reads['sequences']:.1f} ms as sequences")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
