"""A small Vision Transformer, data x tensor parallel, on 8 simulated CPU devices.

The model is written once, with `eqxpar.nn` layers: each image is cut into p x p
patches, every flattened patch goes through one linear layer (a plain weight,
whole on every device), learned position embeddings are added (and, with
`--pool first`, a class token in front), an `nn.Stacked` of non-causal
`nn.TransformerBlock`s with dropout encodes the tokens, a final `nn.LayerNorm`
and a pooling helper (`nn.mean_pool` or `nn.first_token`) give one vector per
image, and a plain linear head gives the class logits. The data is made here, no
download: 16 x 16 noisy images of stripes at one of `--classes` orientations
(the class), with random spacing, phase and contrast.

The mesh is data 4 x tensor 2, and `rules.MEGATRON` splits the attention heads
and the MLP features over `tensor` (the plans are `vit/*` in `_plans.py`):

    python examples/vision_transformer.py              # auto: jit; the compiler places the collectives
    python examples/vision_transformer.py --mode sp    # manual, sequence parallel: tokens split over tensor

Under sequence parallelism each device of `tensor` holds a block of the tokens:
`nn.split_sequence` cuts the patches and the position table before the patch
embedding, the blocks all-gather and reduce-scatter around their layers, and the
pooling helpers average (or fetch the first token) over the whole sequence. The
token count (patches, plus one with `--pool first`) must then divide by the
tensor size: 16 patches do, 17 tokens do not, and eqxpar says so
(`--mode sp --pool first` stops with its `DivisibilityError`; `--image-size 20`
makes 25 patches + 1 = 26 tokens, which divide). The training step hands the
loss a fresh dropout key each step (`key=` in the loss's signature); under
sequence parallelism it is folded with the device's index, so every token block
draws its own mask.

Prints the loss and the held-out accuracy (chance is 1 / classes) as it trains,
then the mesh and the plan.
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _loop import adamw_warmup_cosine  # noqa: E402
from _plans import PLANS, variants  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar import nn  # noqa: E402


class ViT(eqx.Module):
    """Patches -> linear embedding + positions (+ class token) -> encoder blocks ->
    norm -> pooled -> linear head. Runs unchanged on one device and under every
    data x tensor plan: the patch embedding and the head are plain weights (whole
    on every device), the blocks are `eqxpar.nn` layers, and the sequence-dependent
    steps go through `nn.split_sequence` and the pooling helpers."""

    patch_weight: jax.Array  # (patch * patch, d_model)
    patch_bias: jax.Array  # (d_model,)
    positions: jax.Array  # (tokens, d_model)
    cls: jax.Array | None  # (d_model,) with pool="first", else None
    dropout: nn.Dropout
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head_weight: jax.Array  # (d_model, classes)
    head_bias: jax.Array  # (classes,)
    patch: int = eqx.field(static=True)
    pool: str = eqx.field(static=True)

    def __init__(
        self,
        *,
        image_size: int,
        patch: int,
        d_model: int,
        layers: int,
        heads: int,
        classes: int,
        dropout: float = 0.0,
        pool: str = "mean",
        key: jax.Array,
    ):
        if image_size % patch:
            raise ValueError(f"--image-size {image_size} is not a multiple of --patch {patch}")
        if pool not in ("mean", "first"):
            raise ValueError(f"pool={pool!r}: expected 'mean' or 'first'")
        k_patch, k_pos, k_blocks, k_head = jax.random.split(key, 4)
        patches = (image_size // patch) ** 2
        self.patch, self.pool = patch, pool
        self.patch_weight = jax.random.normal(k_patch, (patch * patch, d_model)) / patch
        self.patch_bias = jnp.zeros((d_model,))
        self.positions = 0.02 * jax.random.normal(k_pos, (patches + (pool == "first"), d_model))
        self.cls = jnp.zeros((d_model,)) if pool == "first" else None
        self.dropout = nn.Dropout(dropout)
        encoder = nn.BlockConfig(nn.AttentionConfig(heads, causal=False), dropout=dropout)
        self.blocks = nn.Stacked(
            lambda k: nn.TransformerBlock(d_model, 4 * d_model, encoder, key=k),
            depth=layers,
            key=k_blocks,
        )
        self.norm = nn.LayerNorm(d_model)
        self.head_weight = jax.random.normal(k_head, (d_model, classes)) / np.sqrt(d_model)
        self.head_bias = jnp.zeros((classes,))

    def patchify(self, images: jax.Array) -> jax.Array:
        """`(batch, H, W)` -> `(batch, patches, patch * patch)`, patches row by row;
        with a class token, an all-zero patch in front (the token's slot)."""
        b, h, w = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p).transpose(0, 1, 3, 2, 4).reshape(b, -1, p * p)
        if self.cls is not None:
            x = jnp.concatenate([jnp.zeros((b, 1, p * p), x.dtype), x], axis=1)
        return x

    def __call__(self, images: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Class logits `(batch, classes)`; dropout only when given a `key`."""
        k_embed, k_blocks = jax.random.split(key) if key is not None else (None, None)
        # This device's tokens: all of them, or its block under sequence
        # parallelism. Split the inputs (patches, position table), not the
        # embedded activations: the backward pass then sums small weight
        # gradients over `tensor`, not a whole activation.
        patches = nn.split_sequence(self.patchify(images))
        table = self.positions
        if self.cls is not None:
            # Token 0's patch is zeros: its embedding is the class token.
            table = table.at[0].add(self.cls - self.patch_bias)
        h = (
            patches @ self.patch_weight
            + self.patch_bias[None, None]
            + nn.split_sequence(table, seq_dim=0)[None]
        )
        h = self.dropout(h, key=k_embed)
        h = self.norm(self.blocks(h, key=k_blocks))
        pooled = nn.mean_pool(h) if self.pool == "mean" else nn.first_token(h)
        return pooled @ self.head_weight + self.head_bias[None]


def loss_fn(model: ViT, batch, *, key=None):
    """Mean cross-entropy; the train step passes a fresh `key` (dropout) each step."""
    images, labels = batch
    logits = model(images, key=key)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def make_images(rng: np.random.Generator, n: int, size: int, classes: int):
    """`n` images of stripes and their labels: the stripes' orientation is the
    class (`classes` angles over 180 degrees, jittered by a tenth of their
    spacing), with random spacing (2 to 4 stripes across), phase and contrast,
    under Gaussian noise. Deterministic given `rng`."""
    labels = rng.integers(0, classes, n)
    angle = (labels + rng.uniform(-0.1, 0.1, n)) * np.pi / classes
    freq = rng.uniform(2.0, 4.0, n)
    phase = rng.uniform(0.0, 2 * np.pi, n)
    contrast = rng.uniform(0.3, 1.0, n)
    yy, xx = (np.mgrid[0:size, 0:size] + 0.5) / size - 0.5
    along = xx[None] * np.cos(angle)[:, None, None] + yy[None] * np.sin(angle)[:, None, None]
    images = contrast[:, None, None] * np.sin(2 * np.pi * freq[:, None, None] * along + phase[:, None, None])
    images += rng.normal(0.0, 1.0, images.shape)
    return images.astype(np.float32), labels.astype(np.int32)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=variants("vit"), default="auto")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64, help="a multiple of the data size (4)")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--patch", type=int, default=4, help="divides the image size")
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="a multiple of the tensor size (2)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--pool", choices=("mean", "first"), default="mean", help="mean of the tokens, or a class token"
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-size", type=int, default=512)
    return parser.parse_args(argv)


def make_plan(args) -> eqxpar.Plan:
    return PLANS[f"vit/{args.mode}"].plan()


def describe(plan: eqxpar.Plan) -> str:
    mesh = " x ".join(f"{k} {v}" for k, v in plan.mesh.shape.items() if v > 1)
    how = "manual, sequence parallel" if plan.sequence_parallel else plan.mode
    return f"mesh {mesh}; plan mode {how}, rules MEGATRON (heads and MLP features over tensor)"


def run(args) -> float:
    start = time.perf_counter()
    plan = make_plan(args)
    model = eqx.filter_jit(
        lambda key: ViT(
            image_size=args.image_size,
            patch=args.patch,
            d_model=args.d_model,
            layers=args.layers,
            heads=args.heads,
            classes=args.classes,
            dropout=args.dropout,
            pool=args.pool,
            key=key,
        )
    )(jax.random.key(0))
    tokens = model.positions.shape[0]
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"ViT: {args.image_size}x{args.image_size} images, {args.patch}x{args.patch} patches, {tokens} tokens "
        f"({args.pool} pooling), {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"dropout {args.dropout}, {params:,} parameters; {args.classes} classes"
    )
    optimizer = adamw_warmup_cosine(args.lr, args.steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(loss_fn, optimizer, plan)

    # Held-out images from their own seed; evaluated under plain jit (one program
    # over the trained, sharded arrays), without a key: no dropout.
    eval_images, eval_labels = make_images(
        np.random.default_rng(1), args.eval_size, args.image_size, args.classes
    )

    @eqx.filter_jit
    def accuracy(model, images, labels):
        return jnp.mean(jnp.argmax(model(images), axis=-1) == labels)

    rng = np.random.default_rng(0)
    chance = 1 / args.classes
    for i in range(args.steps):
        state, metrics = step(state, make_images(rng, args.batch_size, args.image_size, args.classes))
        # One step in flight at a time (XLA:CPU's collectives; see _loop.train).
        jax.block_until_ready(metrics["loss"])
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            acc = float(accuracy(state.model, eval_images, eval_labels))
            print(
                f"step {i + 1}: loss {float(metrics['loss']):.3f}, held-out accuracy {acc:.3f} "
                f"(chance {chance:.3f})",
                flush=True,
            )
    acc = float(accuracy(state.model, eval_images, eval_labels))
    print(f"final held-out accuracy {acc:.3f} (chance {chance:.3f}); {time.perf_counter() - start:.1f} s")
    print(describe(plan))
    return acc


def main(argv=None):
    args = parse_args(argv)
    print(f"vision transformer, mode {args.mode}")
    try:
        return run(args)
    except eqxpar.DivisibilityError as e:
        # E.g. a token count that sequence parallelism cannot split: eqxpar's message says what to pad.
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
