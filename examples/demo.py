"""eqxpar's main demo: a GPT trained on Python's own documentation, on 8 simulated
CPU devices, pipeline x data x tensor parallel (2 x 2 x 2) by default.

The model is `eqxpar.models.GPT` (rotary positions, SwiGLU MLPs, grouped-query
attention, tied embeddings, blocks in one scanned stack), built only from
`eqxpar.nn` layers, trained at character level on `pydoc_data.topics` (the help
texts that ship with every CPython: nothing to download). The same model runs
under any plan; the flags choose it:

    python examples/demo.py                  # pipe 2 x data 2 x tensor 2, 1F1B, 4 micro-batches
    python examples/demo.py --schedule zero_bubble          # another pipeline schedule
    python examples/demo.py --data 1 --fsdp 2               # pipe 2 x fsdp 2 x tensor 2
    python examples/demo.py --pipe 1 --fsdp 2               # data 2 x fsdp 2 x tensor 2, automatic (GSPMD)
    python examples/demo.py --pipe 1 --fsdp 2 --mode manual --sequence-parallel  # eqxpar's collectives
    python examples/demo.py --pipe 1 --fsdp 2 --mode manual --sequence-parallel --tp-overlap  # ring matmuls
    python examples/demo.py --pipe 1 --data 8 --tensor 1    # plain data parallel

It prints where every array lives and what one step communicates
(`eqxpar.inspect.sharding_table` / `comm_report`), a progress bar with
periodic evaluation, the final evaluation loss beside the unigram entropy of the
text (the loss of a model that ignores context), the training throughput (tokens/s
and MFU, `eqxpar.train.Throughput`) and a sample of generated text.
The loss curve goes to `<out>/loss.png`, the sample to `<out>/sample.txt`, and the
metrics to `<out>/metrics.jsonl` (and TensorBoard event files, `<out>/tensorboard`).
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _loop import adamw_warmup_cosine, train  # noqa: E402
from _model import PIPELINE_LOSS  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar.models import GPT, GPTConfig, flops_per_token, generate, lm_loss  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mesh = parser.add_argument_group("mesh and plan")
    mesh.add_argument("--data", type=int, default=2, help="data-parallel devices")
    mesh.add_argument("--fsdp", type=int, default=1, help="FSDP devices (weights and batch split)")
    mesh.add_argument("--tensor", type=int, default=2, help="tensor-parallel devices")
    mesh.add_argument("--pipe", type=int, default=2, help="pipeline stages (1: no pipeline)")
    mesh.add_argument(
        "--mode",
        choices=["auto", "manual"],
        default=None,
        help="default auto; a pipeline (--pipe > 1) takes none",
    )
    mesh.add_argument(
        "--manual-axes",
        default="tensor",
        help="with --mode manual: the axes eqxpar issues collectives for, comma-separated, or 'all' "
        "(default: tensor; data and fsdp stay the compiler's)",
    )
    mesh.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="split activations between blocks along the sequence over tensor",
    )
    mesh.add_argument(
        "--tp-overlap", action="store_true", help="ring collective matmuls (manual mode, sequence parallel)"
    )
    mesh.add_argument("--schedule", default="1f1b", help="pipeline schedule (with --pipe > 1)")
    mesh.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (with --pipe > 1)")
    # "dots": matmul outputs kept, the rest recomputed. Under the pipeline a stage
    # keeps its forward's residuals by this policy for its backward; "none" would
    # keep every intermediate, which on this small model costs more (buffering
    # them) than recomputing saves.
    mesh.add_argument("--remat", default="dots", help="what the scanned blocks keep for backward")
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=400)
    run.add_argument("--batch-size", type=int, default=32)
    run.add_argument("--seq-len", type=int, default=64)
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--eval-every", type=int, default=100)
    model = parser.add_argument_group("model")
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--d-hidden", type=int, default=384)
    parser.add_argument("--sample-len", type=int, default=400, help="characters to generate at the end")
    parser.add_argument(
        "--advise",
        action="store_true",
        help="print eqxpar.advise's ranked plans for this GPT on the available devices, then exit",
    )
    parser.add_argument("--out", default="demo_out", help="directory for loss.png and sample.txt")
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> eqxpar.Plan:
    """The plan the flags describe (the defaults: `demo/3d` in `_plans.py`)."""
    mesh = eqxpar.make_mesh(data=args.data, pipe=args.pipe, fsdp=args.fsdp, tensor=args.tensor)
    options = dict(
        rules=eqxpar.rules.MEGATRON_FSDP,
        mode=args.mode,
        sequence_parallel=args.sequence_parallel,
        tp_overlap=args.tp_overlap,
        remat=args.remat,
    )
    if args.mode == "manual" and args.manual_axes != "all":
        options["manual_axes"] = tuple(a.strip() for a in args.manual_axes.split(","))
    if args.pipe == 1:
        return eqxpar.Plan(mesh, **options)
    options["rules"] = eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON_FSDP)
    options.pop("manual_axes", None)  # a pipeline step is manual over every axis
    return eqxpar.Plan(mesh, schedule=args.schedule, microbatches=args.microbatches, **options)


def decode(data: CharData, ids) -> str:
    # The vocabulary is padded to a multiple of the tensor size; padding ids never
    # occur in the text, but a sample could still draw one.
    return "".join(data.vocab[i] if i < data.vocab_size else "?" for i in np.asarray(ids).tolist())


def save_curve(path: pathlib.Path, train_losses, evals, entropy: float, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(train_losses) + 1), train_losses, lw=0.8, alpha=0.7, label="train loss")
    if evals:
        steps, values = zip(*evals, strict=True)
        ax.plot(steps, values, "o-", label="eval loss")
    ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / character")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def gpt_config(args: argparse.Namespace, data: CharData, **more) -> GPTConfig:
    """The demo's GPT from its arguments (`more`: other `GPTConfig` fields)."""
    return GPTConfig(
        # The vocabulary is split over `tensor`: pad it to a multiple (the extra ids never occur).
        vocab_size=data.padded_vocab_size(args.tensor),
        d_model=args.d_model,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        num_layers=args.layers,
        d_hidden=args.d_hidden,
        max_seq_len=args.seq_len,
        **more,
    )


def sample_text(model: GPT, ids: list[int], args: argparse.Namespace) -> list[int]:
    """`args.sample_len` characters after `ids`, drawn with a key/value cache in
    windows of the context the model was trained at: each window starts from the
    last half window of text. `max_length` is the same for every window, so one
    compilation serves them all."""
    key, context = jax.random.key(2), args.seq_len // 2
    end = len(ids) + args.sample_len
    while len(ids) < end:
        window = ids[-context:]
        steps = min(args.seq_len - len(window), end - len(ids))
        out = generate(
            model,
            jax.numpy.asarray(window, jax.numpy.int32),
            steps=steps,
            key=jax.random.fold_in(key, len(ids)),
            temperature=0.8,
            max_length=args.seq_len,
        )
        ids = ids + np.asarray(out.tokens[len(window) :]).tolist()
    return ids


def print_throughput(meter: eqxpar.train.Throughput) -> None:
    """Tokens/s and MFU over the steps after the first (which compiles)."""
    if not meter.steps:
        print(f"throughput: no step timed (the first, {meter.warmup_seconds[0]:.1f} s, compiles)")
        return
    s = meter.summary()
    against = "measured matmul rate" if meter.peak_is_measured else "dense peak"
    print(
        f"throughput: {s['tokens_per_s']:,.0f} tokens/s, {s['model_flops_per_s'] / 1e9:.2f} model GFLOP/s, "
        f"MFU {s['mfu']:.2%} of {meter.devices} x the {meter.profile.name} profile's {against} "
        f"({meter.peak_flops_per_s / 1e12:.2f} TFLOP/s); first step {meter.warmup_seconds[0]:.1f} s"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    data = CharData()
    plan = make_plan(args)
    # A pipeline runs the stack stage by stage, the embedding and the head on the
    # first and last stage: sequentially composed, exactly lm_loss.
    loss_fn = PIPELINE_LOSS if plan.schedule else lm_loss
    entropy = data.unigram_entropy()
    config = gpt_config(args, data)
    # Built under jit: one compilation for the whole initialisation.
    model = eqx.filter_jit(GPT)(config, key=jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    mesh_text = " x ".join(f"{a} {n}" for a, n in plan.mesh.shape.items() if n > 1) or "one device"
    # A pipeline step is one shard_map over every axis: the layers issue their own collectives.
    mode = "manual (pipeline)" if plan.schedule is not None else plan.mode
    if plan.manual_axes is not None and set(plan.manual_axes) != set(plan.mesh.axis_names):
        mode += " over " + ", ".join(plan.manual_axes)
    mode += ", sequence parallel" if args.sequence_parallel else ""
    mode += ", ring overlap" if args.tp_overlap else ""
    if args.pipe > 1:
        mode += f", pipeline {args.schedule} x {args.microbatches} micro-batches"
    print(f"mesh {mesh_text}; mode {mode}")
    print(
        f"GPT: {n_params:,} parameters, {config.num_layers} layers, d_model {config.d_model}, "
        f"{config.num_heads} heads ({config.num_kv_heads} kv), vocab {config.vocab_size}; "
        f"text: {len(data.ids):,} characters"
    )

    optimizer = adamw_warmup_cosine(args.lr, args.steps)
    if args.advise:
        # Predicted from shapes (nothing compiles): every plan for these devices.
        tokens = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jax.numpy.int32)
        advice = eqxpar.advise(
            model,
            lm_loss,
            optimizer,
            tokens,
            devices=jax.device_count(),
            device="cpu",
            pipeline_loss=PIPELINE_LOSS,
        )
        print(advice.table(rejected=False))
        return {"advice": advice}
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(loss_fn, optimizer, plan)

    rng = np.random.default_rng(0)

    def next_batch():
        return data.windows(rng, args.batch_size, args.seq_len + 1)

    print(eqxpar.inspect.sharding_table(state.model, plan))
    # Compiles the step: the executable the first training step then reuses.
    print(eqxpar.inspect.comm_report(step, state, next_batch()))

    # Held-out loss under the same plan (a pipeline runs its forwards only).
    eval_step = eqxpar.train.make_eval_step(loss_fn, plan)
    eval_batches = [data.windows(np.random.default_rng(1), 128, args.seq_len + 1, split="eval")]
    train_losses, evals = [], []
    # Tokens/s and MFU. The "cpu" profile has no published peak, so MFU here is
    # against the measured float32 matmul rate (the demo computes in float32) of
    # the whole CPU: the 8 simulated devices share it, so the hardware is 1 device.
    meter = eqxpar.train.Throughput(
        tokens_per_step=args.batch_size * args.seq_len,
        flops_per_token=flops_per_token(config, seq_len=args.seq_len),
        device="cpu",
        devices=1,
        dtype="float32",
    )

    def recording_step(state, batch):
        state, metrics = step(state, batch)
        # Wait for each step: XLA:CPU runs the 8 simulated devices on a few threads,
        # and with many steps queued (asynchronous dispatch) their collectives can
        # stall waiting for each other until XLA aborts. One step at a time costs
        # almost nothing here (a step is far longer than its dispatch).
        meter.tick(metrics["loss"])
        train_losses.append(float(metrics["loss"]))
        return state, metrics

    def recording_eval(steps_done, value):
        evals.append((steps_done, value))
        meter.start()  # the evaluation is not training time

    out = pathlib.Path(args.out)
    # Metrics as JSON lines, and as TensorBoard event files where tensorboardX is installed.
    trackers = [eqxpar.train.JsonLinesTracker(out / "metrics.jsonl")]
    try:
        trackers.append(eqxpar.train.TensorBoardTracker(out / "tensorboard"))
    except eqxpar.EqxparError:
        pass
    tracker = eqxpar.train.Trackers(trackers)
    state = train(
        recording_step,
        state,
        next_batch,
        eval_step,
        eval_batches,
        steps=args.steps,
        every=args.eval_every,
        on_eval=recording_eval,
        tracker=tracker,
    )
    tracker.close()
    final = evals[-1][1]
    print(f"final eval loss {final:.3f} nats/char (unigram entropy {entropy:.3f})")
    print_throughput(meter)

    prompt = "Python "
    ids = sample_text(state.model, [data.index[c] for c in prompt], args)
    sample = decode(data, ids)
    print("sample:\n" + sample)

    out.mkdir(parents=True, exist_ok=True)
    (out / "sample.txt").write_text(sample + "\n")
    title = f"GPT on pydoc topics: {mesh_text}" + (
        f", {args.schedule}" if args.pipe > 1 else f", {args.mode or 'auto'}"
    )
    if save_curve(out / "loss.png", train_losses, evals, entropy, title):
        print(f"loss curve: {out / 'loss.png'}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    throughput = meter.summary() if meter.steps else None
    return {"final_eval_loss": final, "unigram_entropy": entropy, "sample": sample, "throughput": throughput}


if __name__ == "__main__":
    main()
