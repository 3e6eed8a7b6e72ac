"""Multi-head attention with heads split over the tensor axis."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._context_split import (
    check_context_split,
    check_ulysses_heads,
    context_attention_impl,
    context_size,
    note_keys,
)
from .._errors import PlanError, SpecError
from .._mesh import CONTEXT_AXIS
from .._param import param
from .._remat import name_activation
from ._attention_config import AttentionConfig
from ._blockwise import (
    blockwise_attention,
    dropout_rows,
    dropout_scale,
    dropout_seed,
    segment_allowed,
)
from ._context import TensorContext, tensor_context
from ._context_attention import context_attention
from ._linear import _normal
from ._lora import AttentionLoRA, adapter_pairs, column_with_adapters, lora_dropout, row_adapter
from ._matmul import check_bias, check_split, column_matmul, lift, row_matmul
from ._rotary import RotaryScaling, apply_rotary
from ._sequence import split_context
from ._sequence_layout import context_positions


class Attention(eqx.Module):
    """Causal (or masked) multi-head self-attention, heads split over the tensor axis.

    Query, key and value projections are column-parallel (each device computes its
    own heads), attention runs on local heads with no communication, and the
    output projection is row-parallel.

    **Arguments:**

    - `d_model`: model width.
    - `config`: an `eqxpar.nn.AttentionConfig`: the heads (`num_heads`,
      `num_kv_heads`, `head_dim`), `fused_qkv`, `causal`, rotary position
      embeddings (`rotary`, `rotary_base`, `rotary_scaling`), the `kernel` and its
      `block_size`, `dropout` and the biases (`use_bias`, `qkv_bias`).
    - `axis="tensor"`, `dtype`, `key` (keyword-only).

    Rotary positions are the tokens' global indices `0 .. seq - 1` in every mode:
    the projections hold the whole sequence (under sequence parallelism they
    gather it first). The `"auto"` kernel uses cuDNN's fused attention
    (`jax.nn.dot_product_attention`) on GPU where it applies (bfloat16 or float16,
    head_dim a multiple of 8 up to 128, no `mask`, no dropout). Attention dropout
    is applied when the call gets a `key`. Whether a probability is kept is a hash
    of (seed drawn from the key, batch row, global head, global query position,
    global key position), not a random tensor: the dense, blockwise and context
    paths, the backward pass's recomputed tiles and every split of the heads
    (tensor parallelism: global head indices) or of the sequence (context
    parallelism: global positions) drop the same probabilities for one key.

    Under context parallelism (a `context` mesh axis larger than 1) each device
    holds its load-balanced part of the sequence: attention runs
    `eqxpar.nn.context_attention` over `context` (the plan's `context_attention`:
    ring or all-gather of keys and values, or Ulysses' all-to-alls, which need
    the query heads on each device, after any tensor split, to be a multiple of
    the `context` size), rotary angles at the tokens' global
    positions, and `mask` is not supported (use `segment_ids`).

    Calling it: `attn(x, *, mask=None, segment_ids=None, positions=None, key=None)` (`key`: for
    the config's `dropout` and the adapters' `lora.dropout`; without it no dropout). `mask`
    `(seq, seq)` bool
    keeps key `j` for query `i` (not under context parallelism). `segment_ids`
    `(batch, seq)` integers: query `i` of row `b` reads key `j` only when
    `segment_ids[b, i] == segment_ids[b, j]` (packed documents; padding as its own
    id), ANDed with `causal` and `mask`. They are always the whole sequence's ids in
    global order, like token ids (the local batch rows under a manual data split):
    under sequence parallelism the projections hold the whole sequence, and under
    context parallelism the layer cuts this device's chunks itself, as
    `eqxpar.nn.split_sequence` cuts the activations, and the ids travel with the
    keys and values. `positions` `(batch, seq)` integers, given like `segment_ids`
    (the whole sequence's, in global order): the rotary angle of each token (a
    packed document's positions restart at 0), instead of its index in the row;
    without rotary they are unused.

    Input and output `(batch, seq, d_model)` (the local sequence block under
    sequence parallelism in manual mode).

    ```python
    config = eqxpar.nn.AttentionConfig(8, num_kv_heads=2, rotary=True)
    attn = eqxpar.nn.Attention(256, config, key=key)
    y = attn(x)                             # x: (batch, seq, 256)
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 2, 2]])  # three documents packed in one row
    y = attn(x8, segment_ids=seg)           # x8: (1, 8, 256)
    ```
    """

    wq: Float[Array, "d_model heads head_dim"] | None = param(axes=("embed", "heads", None))
    wk: Float[Array, "d_model kv_heads head_dim"] | None = param(axes=("embed", "kv_heads", None))
    wv: Float[Array, "d_model kv_heads head_dim"] | None = param(axes=("embed", "kv_heads", None))
    wqkv: Float[Array, "d_model three heads head_dim"] | None = param(axes=("embed", None, "heads", None))
    bq: Float[Array, "heads head_dim"] | None = param(axes=("heads", None))
    bk: Float[Array, "kv_heads head_dim"] | None = param(axes=("kv_heads", None))
    bv: Float[Array, "kv_heads head_dim"] | None = param(axes=("kv_heads", None))
    wo: Float[Array, "heads head_dim d_model"] = param(axes=("heads", None, "embed"))
    bo: Float[Array, " d_model"] | None = param(axes=("embed",))
    d_model: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    rotary: bool = eqx.field(static=True)
    rotary_base: float = eqx.field(static=True)
    attention: str = eqx.field(static=True, default="auto")
    attention_block: int = eqx.field(static=True, default=512)
    dropout: float = eqx.field(static=True, default=0.0)
    rotary_scaling: RotaryScaling | None = eqx.field(static=True, default=None)
    # Low-rank adapters on the projections (`eqxpar.models.add_lora`); None: none.
    lora: AttentionLoRA | None = None

    def __init__(
        self,
        d_model: int,
        config: AttentionConfig,
        *,
        axis: str = "tensor",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if not isinstance(config, AttentionConfig):
            raise PlanError(
                f"Attention(d_model, config={config!r}): expected an eqxpar.nn.AttentionConfig, e.g. "
                "Attention(256, eqxpar.nn.AttentionConfig(8), key=key)."
            )
        c = config
        heads, kv, hd = c.num_heads, c.kv_heads, c.head_dim_for(d_model)
        kq, kk, kvk, ko = jax.random.split(key, 4)
        self.wq = self.wk = self.wv = self.wqkv = None
        if c.fused_qkv:
            self.wqkv = _normal(kq, (d_model, 3, heads, hd), d_model, dtype)
        else:
            self.wq = _normal(kq, (d_model, heads, hd), d_model, dtype)
            self.wk = _normal(kk, (d_model, kv, hd), d_model, dtype)
            self.wv = _normal(kvk, (d_model, kv, hd), d_model, dtype)
        in_bias = c.use_bias if c.qkv_bias is None else c.qkv_bias
        self.bq = jnp.zeros((heads, hd), dtype) if in_bias else None
        self.bk = jnp.zeros((kv, hd), dtype) if in_bias else None
        self.bv = jnp.zeros((kv, hd), dtype) if in_bias else None
        self.wo = _normal(ko, (heads, hd, d_model), heads * hd, dtype)
        self.bo = jnp.zeros((d_model,), dtype) if c.use_bias else None
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, heads, kv, hd
        self.causal, self.axis = c.causal, axis
        self.rotary, self.rotary_base = c.rotary, float(c.rotary_base)
        self.rotary_scaling = c.rotary_scaling
        self.attention, self.attention_block = c.kernel, c.block_size
        self.dropout = float(c.dropout)
        self.lora = None

    def __call__(
        self,
        x: Float[Array, "batch seq_in d_model"],
        *,
        mask: Bool[Array, "seq seq"] | None = None,
        segment_ids: Int[Array, "_batch _seq"] | None = None,
        positions: Int[Array, "_batch _seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "batch seq_out d_model"]:
        ctx = tensor_context(self.axis)
        k_lora = None
        if key is not None and lora_dropout(self) > 0:
            # Split off only then: the attention dropout's key stays what it was.
            key, k_lora = jax.random.split(key)
        k_in, k_out = (None, None) if k_lora is None else tuple(jax.random.split(k_lora))
        q, k, v = self.project(x, ctx, key=k_in)
        note_keys(k)
        n = context_size()
        split = n > 1
        # q and k hold the whole sequence (or, under context parallelism, this
        # device's part of it): ids and positions are the whole sequence's, in order.
        expected = (q.shape[0], q.shape[1] * n)
        for name, ids in (("segment_ids", segment_ids), ("positions", positions)):
            if ids is not None and (ids.shape != expected or not jnp.issubdtype(ids.dtype, jnp.integer)):
                raise SpecError(
                    f"Attention({name}=...): shape {ids.shape}, dtype {ids.dtype}; "
                    f"expected integers of shape (batch, seq) = {expected}: one per token of the whole "
                    "sequence in its global order (this device's batch rows under a manual data split), "
                    "as token ids are given; the layer takes this device's part itself."
                )
        if self.rotary:
            # q and k hold the whole sequence here (column_matmul gathers it under
            # sequence parallelism), or under context parallelism this device's part.
            if positions is not None:
                # Per-token positions (packed documents restart at 0): this
                # device's part of them, cut as the activations were.
                positions = split_context(positions)
            elif split:
                positions = context_positions(q.shape[1], load_balanced=True)
            rope = dict(base=self.rotary_base, positions=positions, scaling=self.rotary_scaling)
            q = apply_rotary(q, **rope)
            k = apply_rotary(k, **rope)
        drop = {}
        if key is not None and self.dropout > 0:
            # Global head indices: inside a manual region over the tensor axis this
            # device holds heads [i * local, (i + 1) * local); elsewhere all of them.
            offset = jax.lax.axis_index(self.axis) * q.shape[2] if ctx.manual else 0
            drop = dict(dropout=self.dropout, key=key, head_offset=offset)
        if split:
            core = self._context_core(q, k, v, mask, segment_ids, drop)
        else:
            core = self._core(q, k, v, mask, segment_ids, drop)
        return name_activation(self.output(core, ctx, key=k_out), "out_proj")

    def project(
        self, x: Array, ctx: TensorContext, *, key: PRNGKeyArray | None = None
    ) -> tuple[Array, Array, Array]:
        """Queries, keys and values `(batch, seq, heads, head_dim)` of `x` (this
        device's heads in manual mode), biases added, no rotary yet: the first part
        of `__call__`, shared with cached decoding (`eqxpar.models.generate`).
        `key`: for the adapters' dropout (None: none)."""
        check_split(self.wo.shape[0], self.num_heads, ctx, what="Attention.wo (num_heads)")
        if self.wqkv is not None:
            check_split(self.wqkv.shape[2], self.num_heads, ctx, what="Attention.wqkv (num_heads)")
            (qkv,) = self._project(x, [self.wqkv], ("qkv",), ctx, split_dim=2, key=key)
            qkv = name_activation(qkv, "qkv_proj")
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            check_split(self.wq.shape[1], self.num_heads, ctx, what="Attention.wq (num_heads)")
            check_split(self.wk.shape[1], self.num_kv_heads, ctx, what="Attention.wk (num_kv_heads)")
            q, k, v = self._project(
                x, [self.wq, self.wk, self.wv], ("q", "k", "v"), ctx, split_dim=1, key=key
            )
            # Named for a RematPolicy (MaxText's names): an identity otherwise.
            q, k, v = (
                name_activation(a, n)
                for a, n in zip((q, k, v), ("query_proj", "key_proj", "value_proj"), strict=True)
            )
        check_bias(
            self.bq, self.num_heads, ctx, what="Attention.bq", like="the query weight", split=True, dim=0
        )
        for name in ("bk", "bv"):
            b = getattr(self, name)
            check_bias(
                b,
                self.num_kv_heads,
                ctx,
                what=f"Attention.{name}",
                like="the key/value weight",
                split=True,
                dim=0,
            )
        check_bias(self.bo, self.d_model, ctx, what="Attention.bo", like="Attention.wo", split=False)
        if self.bq is not None:
            q, k, v = q + lift(self.bq, 4), k + lift(self.bk, 4), v + lift(self.bv, 4)
        return q, k, v

    def output(self, core: Array, ctx: TensorContext, *, key: PRNGKeyArray | None = None) -> Array:
        """The output projection of the attended heads `(batch, seq, heads,
        head_dim)`: the last part of `__call__`, shared with cached decoding.
        `key`: for the adapter's dropout (None: none)."""
        heads = ctx.constrain(core, None, ctx.axis, None)
        y = row_matmul(heads, self.wo, ctx, in_dims=2)
        lora = self.lora
        if lora is not None and lora.o_a is not None:
            drop = dict(dropout=lora.dropout, key=key)
            y = y + row_adapter(heads, lora.o_a, lora.o_b, lora.scale, ctx, in_dims=2, **drop)
        return y if self.bo is None else y + lift(self.bo, y.ndim)

    def _project(
        self, x: Array, weights: list[Array], names: tuple[str, ...], ctx, *, split_dim: int, key=None
    ) -> list[Array]:
        # The column-parallel projections, plus their adapters' outputs if any.
        if self.lora is None:
            return column_matmul(x, weights, ctx, split_dim=split_dim)
        pairs = adapter_pairs(self.lora, names)
        drop = dict(dropout=self.lora.dropout, key=key)
        ys, deltas = column_with_adapters(
            x, weights, pairs, self.lora.scale, ctx, split_dim=split_dim, **drop
        )
        index = {name: i for i, name in enumerate(names)}
        for (name, _, _), delta in zip(pairs, deltas, strict=True):
            ys[index[name]] = ys[index[name]] + delta
        return ys

    def _context_core(
        self, q: Array, k: Array, v: Array, mask: Array | None, segment_ids: Array | None, drop: dict
    ) -> Array:
        check_context_split("Attention")
        if mask is not None:
            raise PlanError(
                f"Attention(mask=...) under context parallelism: the mesh's {CONTEXT_AXIS!r} axis splits "
                "the sequence, and a (seq, seq) mask would need every device's part of it. Express "
                "padding and packed sequences with segment_ids=(batch, seq) ids (split like the "
                "tokens), use the causal flag (causal=True / False), or a mesh without a context axis."
            )
        impl = context_attention_impl()
        if impl == "ulysses":
            check_ulysses_heads(self.num_heads, self.num_heads // q.shape[2], context_size(), "Attention")
        if segment_ids is not None:
            # This device's chunks of the ids, cut exactly as the activations were.
            segment_ids = split_context(segment_ids)
        return context_attention(
            q,
            k,
            v,
            causal=self.causal,
            impl=impl,
            segment_ids=segment_ids,
            block_size=self.attention_block,
            **drop,
        )

    def _core(
        self, q: Array, k: Array, v: Array, mask: Array | None, segment_ids: Array | None, drop: dict
    ) -> Array:
        # Attention on the local heads; no collectives on any path.
        masks = dict(mask=mask, segment_ids=segment_ids, **drop)
        if self.attention == "dense":
            return dense_attention(q, k, v, causal=self.causal, **masks)
        if self.attention == "auto":
            if _cudnn_applies(q, mask, segment_ids) and not drop:
                return jax.nn.dot_product_attention(q, k, v, is_causal=self.causal, implementation="cudnn")
            if q.shape[1] <= self.attention_block:
                # One block: the dense scores are one (seq, block) tile, the same temp
                # memory as the blockwise path without its scan and custom VJP, and
                # short-sequence programs (and the HLO the tests count) stay as they were.
                return dense_attention(q, k, v, causal=self.causal, **masks)
        return blockwise_attention(q, k, v, causal=self.causal, block_size=self.attention_block, **masks)


def _cudnn_applies(q: Array, mask: Array | None, segment_ids: Array | None) -> bool:
    # cuDNN's fused attention: GPU, half precision, head_dim a multiple of 8 up to 128.
    # A given mask goes to the blockwise path (a fully masked row averages all keys
    # there, as the dense softmax does; cuDNN's result for such rows differs); so do
    # segment ids (one masking rule, the same on every path and device split).
    d = q.shape[-1]
    return (
        jax.default_backend() == "gpu"
        and mask is None
        and segment_ids is None
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and d % 8 == 0
        and d <= 128
    )


def dense_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool,
    mask: Array | None,
    segment_ids: Array | None = None,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    head_offset: Array | int = 0,
) -> Array:
    """Attention over the whole sequence at once, scores materialised: what
    `Attention` runs when it does not attend blockwise, and the reference the
    blockwise, context-parallel and dropout paths are tested against."""
    # q: (b, s, hq, d); k, v: (b, s, hkv, d). Query head i reads key/value head
    # i // (hq / hkv); with heads split contiguously over the tensor axis every
    # device holds whole groups, so this runs on local heads unchanged.
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, s, hkv, hq // hkv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(jnp.asarray(d, q.dtype))
    allowed = jnp.ones((s, s), bool) if mask is None else mask
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((s, s), bool))
    allowed = lift(allowed, scores.ndim)
    if segment_ids is not None:
        allowed = allowed & segment_allowed(segment_ids, segment_ids)
    scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    if dropout > 0 and key is not None:
        # The blockwise and context paths' mask: a hash of the global coordinates.
        rows = dropout_rows(dropout_seed(key), b, hq, hkv, head_offset, jnp.arange(s))
        weights = weights * dropout_scale(rows, jnp.arange(s), dropout).astype(weights.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, s, hq, d)
