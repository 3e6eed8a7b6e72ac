"""Train a GPT from a token file on disk, or measure reading one, in one or many processes.

The training set is a flat file of token ids (nanoGPT's `train.bin`: raw uint16;
or raw uint32, or a `.npy` array) read through `eqxpar.data.TokenFile`: the file is
memory-mapped and each process reads only its rows of each global batch, so a
file far larger than memory trains as well as a small one, and the global batch
of every step is the same whatever the number of processes. Without `--data` it
writes Python's own documentation text (`pydoc_data.topics`) as a character-level
uint16 file first.

    python examples/token_file.py --steps 30                     # 1 process x 8 devices
    python -m eqxpar.launch -n 2 --devices-per-process 4 examples/token_file.py --steps 30
    python examples/token_file.py --data train.bin --dtype uint16 --vocab-size 50304
    python examples/token_file.py --steps 30 --ckpt-dir /tmp/tf-ckpt --resume   # resumable
    python examples/token_file.py --loader grain                 # the same batches through grain

`--measure` reads batches without a model and prints, per process, tokens read per
second, the resident memory (anonymous and file-backed pages apart: pages of the
mapped file would count as file-backed; TokenFile unmaps each row's once read)
and a hash of every global batch; `--make-file PATH --gb 2` writes a
random uint16 token file of that size to measure on:

    python examples/token_file.py --make-file /tmp/tokens.bin --gb 2
    python examples/token_file.py --data /tmp/tokens.bin --measure --steps 200 --seq-len 1024
    python -m eqxpar.launch -n 2 --devices-per-process 4 examples/token_file.py \\
        --data /tmp/tokens.bin --measure --steps 200 --seq-len 1024
"""

import os

# The launcher gives each process its device count; alone, simulate 8 devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import eqxpar.distributed as dist  # noqa: E402

dist.initialize()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

import eqxpar  # noqa: E402
import eqxpar.checkpoint  # noqa: E402
import eqxpar.data  # noqa: E402
from eqxpar.models import GPT, GPTConfig, lm_loss  # noqa: E402


def make_random_file(path: str, gigabytes: float, *, vocab: int, seed: int = 0) -> int:
    """Write `gigabytes` of random uint16 ids below `vocab`, a chunk at a time; returns the token count."""
    tokens = int(gigabytes * 2**30) // 2
    rng = np.random.default_rng(seed)
    chunk = 1 << 24
    with open(path, "wb") as f:
        for start in range(0, tokens, chunk):
            rng.integers(0, vocab, size=min(chunk, tokens - start), dtype=np.uint16).tofile(f)
    return tokens


def text_file() -> tuple[str, int]:
    """Python's documentation as character ids in a uint16 file; its path and vocabulary size."""
    from _text import CharData

    data = CharData()
    # Each process writes its own copy (same bytes) rather than sharing a path.
    path = os.path.join(tempfile.mkdtemp(prefix="eqxpar-tokens-"), "train.bin")
    data.train_ids.astype(np.uint16).tofile(path)
    return path, data.padded_vocab_size(8)


def memory(path: str) -> dict[str, int]:
    """This process's resident memory in kB: anonymous, file-backed, its peak, and the
    part of the file-backed memory that is pages of the token file at `path`."""
    fields = {"TokenFile": 0}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0])
    # The shared libraries' pages are file-backed too (and page in as JAX runs), so
    # the token file's own share is read from its mapping in smaps.
    target, inside = os.path.realpath(path), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                inside = head[-1] == target
            elif inside and head[0] == "Rss:":
                fields["TokenFile"] += int(head[1])
    return fields


def make_batches(tokens: eqxpar.data.TokenFile, plan: eqxpar.Plan, args, step: int = 0):
    """This process's rows of each global batch, from `ShardedIterator` or grain."""
    if args.loader == "grain":
        return iter(
            eqxpar.data.grain_loader(tokens, plan, batch_size=args.batch_size, seed=args.seed, step=step)
        )
    return eqxpar.data.ShardedIterator(tokens, plan, batch_size=args.batch_size, seed=args.seed, step=step)


def measure(tokens: eqxpar.data.TokenFile, plan: eqxpar.Plan, args) -> None:
    batches = make_batches(tokens, plan, args)
    rows = eqxpar.data.process_slice(args.batch_size, plan)
    digests, read_s, feed_s = [], 0.0, 0.0
    before = memory(tokens.path)
    for _ in range(args.steps):
        start = time.perf_counter()
        local = next(batches)
        read_s += time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(eqxpar.data.global_batch(local, plan))
        feed_s += time.perf_counter() - start
        # An 8-byte digest per row; the global batch's hash is taken over all rows below.
        digests.append(
            [np.frombuffer(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), np.uint8) for r in local]
        )
    read = args.steps * local.size
    mem = memory(tokens.path)
    grew = {k: (mem[k] - before[k]) / 1024 for k in ("RssAnon", "RssFile")}
    dist.log(
        f"rows {rows.start}:{rows.stop} of {args.batch_size}: {read / read_s:,.0f} tokens/s read, "
        f"{read / (read_s + feed_s):,.0f} tokens/s read + global_batch; RssAnon {mem['RssAnon'] / 1024:.0f} MiB "
        f"(+{grew['RssAnon']:.0f} while reading), RssFile {mem['RssFile'] / 1024:.0f} MiB "
        f"(+{grew['RssFile']:.0f}; the token file's pages {mem['TokenFile'] / 1024:.1f} MiB), "
        f"peak RSS {mem['VmHWM'] / 1024:.0f} MiB; "
        f"file {os.path.getsize(tokens.path) / 2**20:,.0f} MiB"
    )
    everyone = multihost_utils.process_allgather(np.stack([np.stack(d) for d in digests], axis=1), tiled=True)
    hashes = [hashlib.sha256(everyone[:, s].tobytes()).hexdigest()[:16] for s in range(args.steps)]
    dist.print_once(
        f"global batch hashes: first {hashes[0]}, last {hashes[-1]}, all {hashlib.sha256(''.join(hashes).encode()).hexdigest()[:16]}"
    )
    if args.hashes_out and dist.is_main_process():
        with open(args.hashes_out, "w") as f:
            json.dump(hashes, f)


def train(tokens: eqxpar.data.TokenFile, plan: eqxpar.Plan, vocab: int, args) -> None:
    config = GPTConfig(
        vocab_size=vocab,
        d_model=args.d_model,
        num_heads=4,
        num_layers=2,
        d_hidden=4 * args.d_model,
        max_seq_len=args.seq_len,
    )
    model = GPT(config, key=jax.random.key(args.seed))
    optimizer = optax.adamw(3e-3)
    # A key built from host data, which every process has (see examples/multihost.py).
    key = jax.random.wrap_key_data(
        jax.device_put(np.asarray(jax.random.key_data(jax.random.key(1))), plan.sharding(PartitionSpec()))
    )
    state = eqxpar.train.init(model, optimizer, plan, key=key)
    step = eqxpar.train.make_step(lm_loss, optimizer, plan)
    manager = None
    if args.ckpt_dir:
        manager = eqxpar.checkpoint.CheckpointManager(args.ckpt_dir, max_to_keep=2)
    start = 0
    if manager is not None and args.resume and manager.latest_step() is not None:
        state, data_state = manager.restore(like=state, plan=plan)
        start = data_state["step"]
        dist.print_once(f"resumed at step {start}")
    batches = make_batches(tokens, plan, args, step=start)
    while int(state.step) < args.steps:
        state, metrics = step(state, eqxpar.data.global_batch(next(batches), plan))
        done = int(state.step)
        if done % 10 == 0 or done == args.steps:
            dist.print_once(f"step {done}: loss {float(metrics['loss']):.4f}")
        if manager is not None and done % args.ckpt_every == 0:
            # The data position is the step: the same state for either loader.
            manager.save(done, state, data_state={"step": done, "seed": args.seed})
    if manager is not None:
        manager.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=None, help="token file (default: write Python's docs as one)")
    parser.add_argument("--dtype", default="uint16", help="ids' type in a raw file (uint16 or uint32)")
    parser.add_argument("--vocab-size", type=int, default=None, help="needed with --data when training")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--loader", choices=["eqxpar", "grain"], default="eqxpar")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--measure", action="store_true", help="read batches and report speed, memory, hashes"
    )
    parser.add_argument(
        "--hashes-out", default=None, help="with --measure: process 0 writes the batch hashes"
    )
    parser.add_argument("--make-file", default=None, help="write a random uint16 token file here and exit")
    parser.add_argument("--gb", type=float, default=2.0, help="with --make-file: its size in GiB")
    args = parser.parse_args(argv)

    if args.make_file:
        count = make_random_file(args.make_file, args.gb, vocab=args.vocab_size or 50304)
        print(
            f"wrote {count:,} tokens ({os.path.getsize(args.make_file) / 2**30:.2f} GiB) to {args.make_file}"
        )
        return
    path, vocab = (args.data, args.vocab_size) if args.data else text_file()
    tokens = eqxpar.data.TokenFile(
        path, seq_len=args.seq_len, dtype=None if path.endswith(".npy") else args.dtype
    )
    plan = eqxpar.Plan(eqxpar.make_mesh(data=-1))
    dist.print_once(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices; {tokens}")
    if args.measure:
        measure(tokens, plan, args)
    elif vocab is None:
        parser.error("--vocab-size is needed to train on --data (the model's vocabulary)")
    else:
        train(tokens, plan, vocab, args)


if __name__ == "__main__":
    main()
