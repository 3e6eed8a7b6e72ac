"""A GPT-style decoder built only from `eqxpar.nn` layers."""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from .. import nn
from .._config_check import renamed
from .._errors import BatchError, DivisibilityError, EqxparError, PlanError, SpecError
from .._param import param
from .._weighted import WeightedMean, constant_weight
from ..nn._lora import lora_dropout
from ..nn._sequence import split_context, split_tensor_sequence
from ._chunked_loss import chunked_token_losses
from ._vocab_tiles import vocab_tiled_losses

# The fields an MoE block's routing reads (its `nn.MoEConfig`, in GPTConfig's names).
_ROUTING_FIELDS = ("experts", "top_k", "moe_score", "capacity_factor", "num_shared_experts")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a `GPT`; frozen and hashable, so the model keeps it as a static field.

    Its fields are flat, one per option (as a Hugging Face `config.json`'s are); the
    layers' configs are made from them: `attention_config` (an
    `eqxpar.nn.AttentionConfig`), `moe_config` (an `eqxpar.nn.MoEConfig`, or None)
    and `block_config(moe=...)` (an `eqxpar.nn.BlockConfig`). Those check the
    fields they take when the config is built; an error names this config's field.
    The grouped form builds one from a block's config: `GPTConfig.from_block(block,
    vocab_size=..., d_model=..., num_layers=..., d_hidden=...)`.

    **Fields:**

    - `vocab_size`: number of token ids (a multiple of the tensor axis size, which
      splits the vocabulary: pad it, the extra ids never occur; or keep the
      vocabulary whole with rules that leave `"vocab"` unsplit).
    - `d_model`: width of the residual stream.
    - `num_heads`: query heads per block (a multiple of the tensor axis size).
    - `num_layers`: number of transformer blocks (one scanned `eqxpar.nn.Stacked`).
    - `d_hidden`: hidden width of each block's MLP (a multiple of the tensor axis size).
    - `num_kv_heads`: key/value heads for grouped-query attention (default `num_heads`).
    - `activation`: `"swiglu"` (default) or `"gelu"`.
    - `norm`: `"rms"` (default) or `"layer"`.
    - `tied`: the output head reuses the embedding's weight (default True).
    - `rotary`: rotary position embeddings in every attention (default True).
    - `rotary_base`: the rotary wavelength base (default 10000.0).
    - `learned_positions`: a learned position table `(max_seq_len, d_model)` added
      to the token embeddings (default False). Independent of `rotary`: GPT-2-style
      models use `rotary=False, learned_positions=True`; with neither, only the
      causal mask tells tokens apart.
    - `max_seq_len`: the longest input the model takes (default 256); with
      learned positions also the most tokens `generate` produces in all.
    - `use_bias`: biases in the attention and MLP projections and the LayerNorms
      (default False). The output head never has one.
    - `fused_qkv`: each attention stores Q, K and V as one weight
      `(d_model, 3, heads, head_dim)` and projects with one matmul (default False:
      three weights). Needs as many key/value heads as query heads.
    - `norm_eps`: the epsilon of every norm (default None: the norm's own, 1e-6
      for RMSNorm and 1e-5 for LayerNorm; Llama 2 and 3 use 1e-5 with RMSNorm).
    - `qkv_bias`: biases on the query, key and value projections (default None:
      as `use_bias`; Qwen2 has them with `use_bias=False`).
    - `rotary_scaling`: an `eqxpar.nn.RotaryScaling` of the rotary frequencies
      (Llama 3.1's long-context rescaling; default None: unscaled).
    - `attention`, `attention_block`: how every attention attends (default "auto"
      and 512: blockwise, memory linear in the sequence, past one block): the
      `kernel` and `block_size` of `eqxpar.nn.AttentionConfig`.
    - `unroll`: entries of the block stack run per iteration of its scan
      (`eqxpar.nn.Stacked(unroll=...)`: blocks, or with `moe_every` groups; default
      1; `num_layers` runs the stack, or a pipeline stage's part of it, with no
      loop: faster on a GPU where the loop costs, slower to compile).
    - `loss_chunk`: sequence positions per chunk of the output head and
      cross-entropy in `lm_loss` / `gpt_last` (default None: the whole sequence at
      once). With it set, the head's matmul and the float32 log-softmax run on
      `loss_chunk` positions at a time in a rematerialised loop, so neither pass
      holds more than one chunk's `(batch, loss_chunk, vocab)` logits (the whole
      sequence's are `4 * batch * seq * vocab` bytes, and as much again for their
      gradient): set it for a large vocabulary (e.g. 1024 for Llama 3's 128,256
      columns), at the cost of running the head's matmul once more in the
      backward pass. Any sequence length works (the last chunk is padded and its
      padding left out), and the loss is the same under every plan. A runtime
      option: `save_pretrained` does not write it, `from_pretrained(...,
      loss_chunk=)` sets it.

    Mixture of experts (all off by default):

    - `moe_every`: 0 (default) for dense blocks only; `k` makes every `k`-th block
      (blocks `k-1, 2k-1, ...`) an MoE block: `num_layers` must be a multiple of
      `k`, and the model runs `num_layers / k` groups of `k-1` dense blocks and one
      MoE block in one scanned stack.
    - `experts`: routed experts per MoE block (needed, > 0, with `moe_every`);
      each is a `d_hidden`-wide MLP of the config's `activation`.
    - `top_k` (default 2), `moe_score` (`"softmax"` or `"sigmoid"`),
      `num_shared_experts` (default 0), `capacity_factor` (default None:
      dropless): the `top_k`, `score`, `num_shared` and `capacity_factor` of
      the MoE blocks' `eqxpar.nn.MoEConfig` (`moe_config`).
    - `load_balance_coef` (default 0.01) and `router_z_coef` (default 1e-3): what
      `lm_loss` adds, times the mean over the MoE blocks of each block's
      `load_balance_loss` and `router_z_loss`.

    ```python
    config = eqxpar.models.GPTConfig(vocab_size=128, d_model=128, num_heads=4,
                                     num_layers=4, d_hidden=384)
    # GPT-2 style: learned positions, GELU, LayerNorm, biases, untied head.
    gpt2 = eqxpar.models.GPTConfig(vocab_size=512, d_model=256, num_heads=4, num_layers=4,
                                   d_hidden=1024, activation="gelu", norm="layer",
                                   tied=False, rotary=False, learned_positions=True,
                                   use_bias=True, fused_qkv=True, max_seq_len=128)
    # Every second block a mixture of 8 experts, each token sent to 2 of them.
    moe = eqxpar.models.GPTConfig(vocab_size=128, d_model=128, num_heads=4, num_layers=4,
                                  d_hidden=256, moe_every=2, experts=8, top_k=2)
    ```
    """

    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    d_hidden: int
    num_kv_heads: int | None = None
    activation: str = "swiglu"
    norm: str = "rms"
    tied: bool = True
    rotary: bool = True
    rotary_base: float = 10000.0
    max_seq_len: int = 256
    use_bias: bool = False
    learned_positions: bool = False
    fused_qkv: bool = False
    attention: str = "auto"
    attention_block: int = 512
    unroll: int = 1
    moe_every: int = 0
    experts: int = 0
    top_k: int = 2
    moe_score: str = "softmax"
    num_shared_experts: int = 0
    # int | float: a coefficient of 0 or a capacity of 2 is as good as 0.0 or 2.0.
    capacity_factor: int | float | None = None
    load_balance_coef: int | float = 0.01
    router_z_coef: int | float = 1e-3
    norm_eps: float | None = None
    qkv_bias: bool | None = None
    rotary_scaling: nn.RotaryScaling | None = None
    loss_chunk: int | None = None

    def __post_init__(self):
        # Every field is checked here, when the config is built, so that a bad one
        # names itself instead of surfacing as a ZeroDivisionError or a shape error
        # deep inside a layer's constructor. The fields the layers take are checked
        # by the layer configs they make (nn.AttentionConfig, nn.MoEConfig,
        # nn.BlockConfig), re-raised under this config's field names.
        for name in ("vocab_size", "d_model", "num_layers", "d_hidden", "max_seq_len", "unroll"):
            _check_positive_int(name, getattr(self, name))
        chunk = self.loss_chunk
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise PlanError(
                f"GPTConfig(loss_chunk={chunk!r}): expected a positive integer (sequence positions per "
                "chunk of the output head and cross-entropy, e.g. 1024), or None for the whole "
                "sequence at once."
            )
        for name in ("tied", "learned_positions"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"GPTConfig({name}={getattr(self, name)!r}): expected True or False.")
        for name in ("moe_every", "experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanError(f"GPTConfig({name}={value!r}): expected an integer >= 0.")
        attention = _as_gpt_config(lambda: self.block_config(moe=bool(self.experts)).attention)
        if self.d_model % self.num_heads:
            raise DivisibilityError(
                f"GPTConfig(d_model={self.d_model}, num_heads={self.num_heads}): the heads split the "
                f"model width, so num_heads must divide d_model. Use d_model a multiple of {self.num_heads}."
            )
        _as_gpt_config(lambda: attention.head_dim_for(self.d_model))
        self._check_moe()

    def _check_moe(self) -> None:
        """The MoE fields only a GPT has: where its MoE blocks go and what the
        loss adds (the routing is `moe_config`'s, checked when it is built)."""
        if self.moe_every and not self.experts:
            raise PlanError(
                f"GPTConfig(moe_every={self.moe_every}, experts=0): MoE blocks need experts to route "
                "to. Pass experts > 0 (e.g. experts=8), or moe_every=0 for a dense model."
            )
        if self.experts and not self.moe_every:
            raise PlanError(
                f"GPTConfig(experts={self.experts}, moe_every=0): experts are used only by MoE blocks, "
                "and moe_every=0 makes none. Pass moe_every=k to make every k-th block an MoE block "
                "(1: every block), or experts=0."
            )
        if not self.experts:
            # A dense model builds no MoE config, yet a bad routing field must not
            # pass silently: checked as an MoE config of as many experts as top_k.
            top_k = self.top_k
            experts = top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else 1
            _as_gpt_config(lambda: self._routing(experts))
        if self.moe_every and self.num_layers % self.moe_every:
            fits = _divisors(self.num_layers)
            raise DivisibilityError(
                f"GPTConfig(num_layers={self.num_layers}, moe_every={self.moe_every}): the blocks run "
                f"as num_layers / moe_every groups of moe_every blocks (the last one MoE), so moe_every "
                f"must divide num_layers. Use moe_every in {fits}, or num_layers a multiple of "
                f"{self.moe_every}."
            )
        for name in ("load_balance_coef", "router_z_coef"):
            value = getattr(self, name)
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not (numeric and math.isfinite(value) and value >= 0):
                raise PlanError(
                    f"GPTConfig({name}={value!r}): expected a finite number >= 0 (the weight of that "
                    "auxiliary loss in lm_loss; 0 leaves it out)."
                )

    @property
    def attention_config(self) -> nn.AttentionConfig:
        """Every block's `eqxpar.nn.AttentionConfig` (causal, `head_dim` `d_model //
        num_heads`, the attention fields of this config; `attention` and
        `attention_block` are its `kernel` and `block_size`)."""
        return nn.AttentionConfig(
            self.num_heads,
            num_kv_heads=self.num_kv_heads,
            fused_qkv=self.fused_qkv,
            rotary=self.rotary,
            rotary_base=self.rotary_base,
            rotary_scaling=self.rotary_scaling,
            kernel=self.attention,
            block_size=self.attention_block,
            use_bias=self.use_bias,
            qkv_bias=self.qkv_bias,
        )

    @property
    def moe_config(self) -> nn.MoEConfig | None:
        """The MoE blocks' `eqxpar.nn.MoEConfig` (`experts`, `top_k`; `moe_score`
        as its `score`, `num_shared_experts` as `num_shared`, `capacity_factor`), or
        None for a dense model."""
        return self._routing(self.experts) if self.experts else None

    def _routing(self, experts: int) -> nn.MoEConfig:
        return nn.MoEConfig(
            experts,
            top_k=self.top_k,
            score=self.moe_score,
            capacity_factor=self.capacity_factor,
            num_shared=self.num_shared_experts,
        )

    def block_config(self, *, moe: bool = False) -> nn.BlockConfig:
        """The `eqxpar.nn.BlockConfig` of the model's dense blocks, or with `moe=True`
        of its MoE blocks (`moe_config` as the feed-forward)."""
        return nn.BlockConfig(
            self.attention_config,
            moe=self.moe_config if moe else None,
            activation=self.activation,
            norm=self.norm,
            norm_eps=self.norm_eps,
            use_bias=self.use_bias,
        )

    @classmethod
    def from_block(
        cls,
        block: Any,  # Any: checked below, with an eqxpar error that names the value
        *,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        d_hidden: int,
        **model: Any,
    ) -> "GPTConfig":
        """The config of a GPT whose blocks are `block`: the grouped form of the flat
        fields, the inverse of `block_config`. `model` takes the fields no layer has
        (`tied`, `max_seq_len`, `learned_positions`, `unroll`, `moe_every` (default 1
        with `block.moe`: every block MoE), `load_balance_coef`, `router_z_coef`).

        A block setting a GPT cannot honour is refused, naming it: a non-causal
        attention, another `head_dim` than `d_model // num_heads`, dropout (the
        attention's or the block's), attention biases unlike the block's, and the
        MoE routing options `GPTConfig` has no field for (`normalize_top_k`,
        `route_scale`, `shared_hidden`).

        ```python
        attention = eqxpar.nn.AttentionConfig(8, num_kv_heads=4, rotary=True, use_bias=False)
        block = eqxpar.nn.BlockConfig(attention, activation="swiglu", norm="rms", use_bias=False)
        config = GPTConfig.from_block(block, vocab_size=128, d_model=256, num_layers=4, d_hidden=512)
        ```
        """
        if not isinstance(block, nn.BlockConfig):
            raise PlanError(f"GPTConfig.from_block(block={block!r}): expected an eqxpar.nn.BlockConfig.")
        attention, moe = block.attention, block.moe
        # A head_dim whose heads fill d_model is what a GPT has anyway.
        fills = attention.head_dim is not None and attention.head_dim * attention.num_heads == d_model
        head_dim = None if fills else attention.head_dim
        refused = [
            ("attention.causal", attention.causal, True),
            ("attention.head_dim", head_dim, None),
            ("attention.dropout", attention.dropout, 0.0),
            ("attention.use_bias", attention.use_bias, block.use_bias),
            ("dropout", block.dropout, 0.0),
        ]
        if moe is not None:
            refused += [
                ("moe.normalize_top_k", moe.normalize_top_k, True),
                ("moe.route_scale", moe.route_scale, 1.0),
                ("moe.shared_hidden", moe.shared_hidden, None),
            ]
        for name, value, wanted in refused:
            if value != wanted:
                raise PlanError(
                    f"GPTConfig.from_block: block.{name}={value!r}, which a GPT cannot honour "
                    f"(it needs {wanted!r}). Build the block with {name.split('.')[-1]}={wanted!r}, or "
                    "compose your own model from eqxpar.nn.TransformerBlock."
                )
        fields = dict(
            vocab_size=vocab_size,
            d_model=d_model,
            num_layers=num_layers,
            d_hidden=d_hidden,
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            fused_qkv=attention.fused_qkv,
            rotary=attention.rotary,
            rotary_base=attention.rotary_base,
            rotary_scaling=attention.rotary_scaling,
            attention=attention.kernel,
            attention_block=attention.block_size,
            qkv_bias=attention.qkv_bias,
            activation=block.activation,
            norm=block.norm,
            norm_eps=block.norm_eps,
            use_bias=block.use_bias,
        )
        if moe is not None:
            fields |= dict(
                moe_every=1,
                experts=moe.experts,
                top_k=moe.top_k,
                moe_score=moe.score,
                capacity_factor=moe.capacity_factor,
                num_shared_experts=moe.num_shared,
            )
        layer_fields = set(fields) | set(_ROUTING_FIELDS)
        if clash := sorted((layer_fields - {"moe_every"}) & set(model)):
            raise PlanError(
                f"GPTConfig.from_block(..., {clash[0]}=...): the block gives {clash[0]}; set it in the "
                "block's config, not beside it."
            )
        return cls(**(fields | model))

    @property
    def head_dim(self) -> int:
        """`d_model // num_heads`."""
        return self.d_model // self.num_heads

    @property
    def moe_layers(self) -> int:
        """The number of MoE blocks: `num_layers // moe_every`, 0 for a dense model."""
        return self.num_layers // self.moe_every if self.moe_every else 0


T = TypeVar("T")

# The layer configs' fields spelled as GPTConfig spells them (the rest are alike).
_LAYER_NAMES = {
    "kernel": "attention",
    "block_size": "attention_block",
    "score": "moe_score",
    "num_shared": "num_shared_experts",
}


def _as_gpt_config(build: Callable[[], T]) -> T:
    """`build()`, whose layer-config errors are re-raised as `GPTConfig`'s, under
    its field names."""
    try:
        return build()
    except EqxparError as err:
        raise renamed(err, "GPTConfig", _LAYER_NAMES) from None


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass, so num_layers=True would otherwise pass as 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"GPTConfig({name}={value!r}): expected a positive integer.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class MoEGroup(eqx.Module):
    """One layer of an MoE `GPT`'s stack: `moe_every - 1` dense blocks, then one MoE
    block, unrolled (the stack scans over the groups, so the dense blocks between
    two MoE blocks need no scan of their own and every layer of the scan is alike).

    **Arguments:** `dense`: the dense `eqxpar.nn.TransformerBlock`s, in order (may
    be empty); `moe`: a `TransformerBlock` whose config has `moe`.

    Calling it: `group(x, *, key=None, segment_ids=None, positions=None) -> (y,
    aux)`, `x` and `y` `(batch, seq, d_model)`, `aux` the MoE block's
    `eqxpar.nn.MoEAux`; `key` is split into one key per block; `segment_ids` and
    `positions` reach every block's attention.

    ```python
    group = eqxpar.models.MoEGroup((dense_block,), moe_block)
    y, aux = group(x)
    ```
    """

    dense: tuple[nn.TransformerBlock, ...]
    moe: nn.TransformerBlock

    def __init__(self, dense: tuple[nn.TransformerBlock, ...], moe: nn.TransformerBlock):
        if not moe.experts:
            raise PlanError(
                "MoEGroup(moe=...): the last block has a dense MLP (experts=0). Build it from "
                "eqxpar.nn.BlockConfig(..., moe=eqxpar.nn.MoEConfig(experts=n)), n > 0."
            )
        if any(block.experts for block in dense):
            raise PlanError(
                "MoEGroup(dense=...): a block of `dense` has experts; the group's one MoE block is "
                "`moe`, the last. Build the dense blocks from a BlockConfig with moe=None."
            )
        self.dense, self.moe = tuple(dense), moe

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        segment_ids: Int[Array, "_batch _seq"] | None = None,
        positions: Int[Array, "_batch _seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq d_model"], nn.MoEAux]:
        n = len(self.dense) + 1
        keys = [None] * n if key is None else list(jax.random.split(key, n))
        packing = dict(segment_ids=segment_ids, positions=positions)
        for block, k in zip(self.dense, keys, strict=False):
            x = block(x, key=k, **packing)
        return self.moe(x, key=keys[-1], **packing)


class GPT(eqx.Module):
    """A pre-norm decoder-only transformer language model, tensor parallel throughout.

    `embed` (vocabulary-parallel `eqxpar.nn.Embedding`), plus `positions` (a
    learned table, or None) -> `blocks` (one `eqxpar.nn.Stacked` of
    `eqxpar.nn.TransformerBlock`s, run by `lax.scan`, with rotary or no positions
    in the attention and SwiGLU or GELU MLPs) -> `final_norm` -> `head` (an
    `eqxpar.nn.Unembed`, or None when the embeddings are tied and
    `embed.attend` scores the output). The same instance runs under every plan:
    on one device, under automatic sharding (data, FSDP, tensor parallel) and in
    manual tensor-parallel steps (sync, sequence parallel, ring overlap,
    partial-manual).

    **Arguments:** `config` (a `GPTConfig`); keyword-only `key`.

    Calling it maps token ids `(batch, seq)` to logits `(batch, seq, vocab)` with
    the vocabulary split over the tensor axis (whole in automatic mode; `vocab / n`
    columns per device in manual mode): feed them to `eqxpar.nn.cross_entropy`,
    or use `lm_loss`.

    With `config.moe_every = k > 0` every `k`-th block is an MoE block and `blocks`
    is one `Stacked` of `num_layers / k` `MoEGroup`s (`k - 1` dense blocks and one
    MoE block each), so compile time still does not grow with depth; the stack then
    returns `(h, aux)`, `aux` an `eqxpar.nn.MoEAux` with a leading dimension of one
    entry per MoE block. `logits_and_aux(tokens)` returns it with the logits, and
    `lm_loss` adds the config's auxiliary losses. MoE models do not run in
    pipelines (`gpt_first` / `gpt_last` raise `PlanError`).

    Packed sequences (several documents per row): `model(tokens,
    segment_ids=seg, positions=pos)`, both `(batch, seq)` integers. No token
    attends to a token of another segment, in every attention kernel and under
    every plan, and the rotary angles and the learned position table read `pos`
    (each document's positions restart at 0) instead of the index in the row.

    ```python
    model = eqxpar.models.GPT(config, key=jax.random.key(0))
    logits = model(tokens)                          # tokens: (batch, seq) int
    loss = eqxpar.models.lm_loss(model, tokens)     # next-token cross-entropy
    ```
    """

    embed: nn.Embedding
    # Replicated over the tensor axis; its model dimension is "embed", so FSDP
    # rules split it like every other weight.
    positions: Float[Array, "max_seq_len d_model"] | None = param(axes=(None, "embed"))
    # Of TransformerBlocks; of MoEGroups with config.moe_every > 0.
    blocks: nn.Stacked
    final_norm: nn.RMSNorm | nn.LayerNorm
    head: nn.Unembed | None
    config: GPTConfig = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        if not isinstance(config, GPTConfig):
            raise PlanError(f"GPT(config={config!r}): expected an eqxpar.models.GPTConfig.")
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        c = config
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model, key=k_embed)
        # A key of its own folded from `key`, so models without the table keep the
        # weights they had before the option existed.
        k_pos = jax.random.fold_in(key, 3)
        self.positions = (
            0.02 * jax.random.normal(k_pos, (c.max_seq_len, c.d_model)) if c.learned_positions else None
        )

        dense = c.block_config()

        def make_block(k, config=dense):
            return nn.TransformerBlock(c.d_model, c.d_hidden, config, key=k)

        def make_group(k):
            keys = jax.random.split(k, c.moe_every)
            moe = make_block(keys[-1], c.block_config(moe=True))
            return MoEGroup(tuple(make_block(kd) for kd in keys[:-1]), moe)

        if c.moe_every:
            self.blocks = nn.Stacked(make_group, depth=c.moe_layers, unroll=c.unroll, key=k_blocks)
        else:
            self.blocks = nn.Stacked(make_block, depth=c.num_layers, unroll=c.unroll, key=k_blocks)
        eps = {} if c.norm_eps is None else {"eps": c.norm_eps}
        self.final_norm = (
            nn.RMSNorm(c.d_model, **eps)
            if c.norm == "rms"
            else nn.LayerNorm(c.d_model, use_bias=c.use_bias, **eps)
        )
        self.head = None if c.tied else nn.Unembed(c.d_model, c.vocab_size, key=k_head)

    def batch_statistic_loss(self) -> tuple[str, str] | None:
        """What makes this model's `lm_loss` inexact under micro-batches, for
        `eqxpar.AccumulationWarning`: `(what, fix)`, or None. The load-balance
        loss of MoE blocks is a product of two batch statistics; the router
        z-loss, a mean over tokens, accumulates exactly."""
        c = self.config
        if not (c.moe_every and c.load_balance_coef):
            return None
        what = (
            f"the model's MoE blocks add a load-balance loss (GPTConfig(load_balance_coef={c.load_balance_coef!r})), "
            "experts * sum_e f_e * P_e, a product of two batch statistics (the router z-loss, a mean over "
            "tokens, is exact)"
        )
        return what, "GPTConfig(load_balance_coef=0) (e.g. balance with eqxpar.nn.update_router_bias instead)"

    def embed_tokens(
        self, tokens: Int[Array, "batch seq"], *, positions: Int[Array, "_batch _seq"] | None = None
    ) -> Float[Array, "batch seq_out d_model"]:
        """The residual stream entering the blocks: token embeddings, plus the
        learned position table's rows if the config has one (its first `seq` rows,
        or with `positions` the row of each token's position; rotary attention adds
        its positions later). Under sequence parallelism in manual mode, this
        device's sequence block.

        **Arguments:** `tokens`: `(batch, seq)` ids, `seq <= config.max_seq_len`;
        keyword-only `positions`: `(batch, seq)` integer positions, each below
        `config.max_seq_len` (default None: `0 .. seq - 1` in every row).

        **Returns:** `(batch, seq', d_model)`.

        ```python
        h = model.logits(model.blocks(model.embed_tokens(tokens)))
        ```
        """
        if tokens.shape[1] > self.config.max_seq_len:
            raise SpecError(
                f"GPT: input of {tokens.shape[1]} tokens (shape {tokens.shape}) is longer than "
                f"config.max_seq_len={self.config.max_seq_len}. Feed at most that many tokens, or "
                "build the model with a larger max_seq_len."
            )
        h = self.embed(tokens)
        if self.positions is None:
            return h
        if positions is None:
            # Under sequence parallelism in manual mode the embedding returns this
            # device's sequence block, so take the same block of the table (a slice).
            table = nn.split_sequence(self.positions[: tokens.shape[1]], seq_dim=0)
            return h + table[None]
        # Cut the positions before the lookup, as the embedding cuts the ids: the
        # backward pass then sums the table's small gradient, not the activations.
        return h + self.positions[nn.split_sequence(positions)]

    def logits(self, h: Float[Array, "batch seq_in d_model"]) -> Float[Array, "batch seq vocab"]:
        """Final norm and output head: `(batch, seq', d_model) -> (batch, seq, vocab)`,
        vocabulary split over the tensor axis, never gathered (tied: scored against
        the embedding's rows).

        **Arguments:** `h`: the blocks' output.

        **Returns:** logits with the whole sequence; where the plan's rules keep the
        vocabulary whole, every column for the `seq'` tokens of `h` instead.

        ```python
        logits = model.logits(model.blocks(model.embed_tokens(tokens)))
        ```
        """
        h = self.final_norm(h)
        return self.embed.attend(h) if self.head is None else self.head(h)

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        segment_ids: Shaped[Array, "_batch _seq"] | None = None,
        positions: Shaped[Array, "_batch _seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """Logits `(batch, seq, vocab)` of token ids `(batch, seq)`, vocabulary split
        over the tensor axis: `logits(blocks(embed_tokens(tokens)))` (an MoE model's
        auxiliary outputs dropped: see `logits_and_aux`). `segment_ids` and
        `positions` (`(batch, seq)` integers, default None) for packed documents:
        see `logits_and_aux`. `key`: for the LoRA adapters' dropout (`add_lora(...,
        dropout=)`; without it, or without adapter dropout, none)."""
        return self.logits_and_aux(tokens, segment_ids=segment_ids, positions=positions, key=key)[0]

    def logits_and_aux(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        segment_ids: Shaped[Array, "_batch _seq"] | None = None,
        positions: Shaped[Array, "_batch _seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], nn.MoEAux | None]:
        """The logits and the MoE blocks' auxiliary outputs.

        **Arguments:** `tokens`: `(batch, seq)` ids; keyword-only `segment_ids`:
        `(batch, seq)` integers, token `i` attends to token `j` only where
        `segment_ids[b, i] == segment_ids[b, j]` (documents packed in a row;
        padding as a segment of its own), in every block; `positions`: `(batch,
        seq)` integers below `config.max_seq_len`, each token's position in its
        document, for the rotary angles and the learned position table (default
        `0 .. seq - 1`); `key` as `__call__`'s. Both are the whole sequence's under
        every plan (split like the tokens: over the batch axes by rows, under
        context or sequence parallelism by the layers themselves).

        **Returns:** `(logits, aux)`: logits as `__call__`'s; `aux` an
        `eqxpar.nn.MoEAux` whose every leaf has a leading dimension of
        `config.moe_layers` (one entry per MoE block: `expert_load` is `(moe_layers,
        experts)`), or None for a dense model.

        **Raises:** `eqxpar.BatchError` for segment ids or positions of another
        shape than the tokens' or not integers, and for positions outside `0 ..
        max_seq_len - 1` (checked where the positions are concrete arrays).

        ```python
        logits, aux = model.logits_and_aux(tokens)
        print(aux.expert_load.sum(0))            # tokens * top_k per MoE block, per expert
        seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])   # two documents in one row
        pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
        logits, _ = model.logits_and_aux(tokens8, segment_ids=seg, positions=pos)
        ```
        """
        packing = _Packing.check(self.config, tokens, segment_ids, positions, None, "GPT")
        _Packing.check_positions(self.config, positions, "GPT")
        h, aux = _run_blocks(
            self, self.embed_tokens(tokens, positions=positions), key, packing.stack_kwargs()
        )
        return self.logits(h), aux


@dataclasses.dataclass(frozen=True)
class _Packing:
    """The packing inputs of one call, checked: `segment_ids`, `positions` and
    `weights` of the tokens' shape (each None when not given)."""

    segment_ids: Array | None
    positions: Array | None
    weights: Array | None

    @classmethod
    def check(
        cls,
        config: GPTConfig,
        tokens: Array,
        segment_ids: Any,
        positions: Any,
        weights: Any,
        where: str,
    ) -> "_Packing":
        """Refuse, naming the argument, packing inputs a call cannot use: another
        shape than `tokens`, non-integer ids or positions, positions outside the
        position table, weights that count no token (the last two where the
        arrays are concrete: under `jit` they are traced values)."""
        shape = tuple(tokens.shape)
        for name, x in (("segment_ids", segment_ids), ("positions", positions), ("weights", weights)):
            if x is None:
                continue
            if not hasattr(x, "shape") or not hasattr(x, "dtype") or tuple(x.shape) != shape:
                got = f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
                raise BatchError(
                    f"{where}({name}=...): {got}; expected an array of the tokens' shape {shape}, one "
                    "value per token (aligned with the tokens: the loss reads the inputs' and the "
                    "targets' parts itself)."
                )
            numeric = jnp.issubdtype(x.dtype, jnp.integer)
            if name == "weights":
                numeric = numeric or jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.bool_
            if not numeric:
                kind = "numbers (float, int or bool)" if name == "weights" else "integers"
                raise BatchError(f"{where}({name}=...): dtype {x.dtype}; expected {kind}.")
        return cls(segment_ids, positions, weights)

    @staticmethod
    def check_positions(config: GPTConfig, positions: Any, where: str) -> None:
        """Refuse concrete `positions` (the model's inputs') outside the position
        table; traced ones (under `jit`) cannot be read here."""
        if positions is None or isinstance(positions, jax.core.Tracer):
            return
        low, high = int(jnp.min(positions)), int(jnp.max(positions))
        if low < 0 or high >= config.max_seq_len:
            raise BatchError(
                f"{where}(positions=...): positions from {low} to {high}; expected 0 .. "
                f"{config.max_seq_len - 1} (config.max_seq_len={config.max_seq_len}: the learned "
                "position table's rows, and the longest sequence the model takes). Restart the "
                "positions with each document, or build the model with a larger max_seq_len."
            )

    def stack_kwargs(self) -> dict[str, Array]:
        """What the blocks take: the segment ids and positions given."""
        given = dict(segment_ids=self.segment_ids, positions=self.positions)
        return {k: v for k, v in given.items() if v is not None}


def _run_blocks(
    model: GPT, h: Array, key: PRNGKeyArray | None = None, packing: dict | None = None
) -> tuple[Array, nn.MoEAux | None]:
    # A dense stack returns h; an MoE stack (h, aux) stacked over its groups. The
    # key reaches the blocks only if an adapter drops out: otherwise the stack's
    # scan would carry per-layer keys nothing reads. Segment ids and positions
    # reach them only when given, so unpacked programs stay as they were.
    kw = {"key": key} if key is not None and _drops_out(model) else {}
    kw |= packing or {}
    if model.config.moe_every:
        return model.blocks(h, **kw)
    return model.blocks(h, **kw), None


def _drops_out(model: GPT) -> bool:
    layers = jax.tree.leaves(model.blocks, is_leaf=_is_layer)
    return any(lora_dropout(x) > 0 for x in layers if _is_layer(x))


def _is_layer(x: object) -> bool:
    return isinstance(x, nn.Attention | nn.MLP)


def _no_pipeline(model: GPT, where: str) -> None:
    if model.config.moe_every:
        raise PlanError(
            f"{where}: this GPT has MoE blocks (moe_every={model.config.moe_every}), whose auxiliary "
            "losses (load balance, router z) a pipeline cannot carry: its stages pass only the "
            "activations, so they would be dropped silently. Train an MoE GPT with "
            "eqxpar.models.lm_loss under a plan without pipe (data, fsdp, tensor), or build the "
            "config with moe_every=0 for a pipeline."
        )


def _check_tokens(tokens: Array, where: str) -> None:
    # One token per sequence predicts nothing: the mean over no predictions is NaN.
    if not hasattr(tokens, "ndim") or tokens.ndim != 2 or tokens.shape[1] < 2:
        got = tuple(tokens.shape) if hasattr(tokens, "shape") else type(tokens).__name__
        raise BatchError(
            f"{where}: tokens of shape {got}; expected (batch, seq + 1) with at least 2 "
            "tokens per sequence (each token predicts the next one, so a sequence of n tokens gives "
            "n - 1 predictions). Pass sequences of length 2 or more."
        )


#: The keys of a packed batch (a mapping) the loss functions read.
_BATCH_KEYS = ("tokens", "segment_ids", "positions", "weights")


@dataclasses.dataclass(frozen=True)
class _LossInputs:
    """One call's tokens `(batch, seq + 1)` and packing inputs, checked, aligned
    with the tokens."""

    tokens: Array
    packing: _Packing

    @classmethod
    def of(cls, model: GPT, batch: Any, where: str, **given: Any) -> "_LossInputs":
        """From `batch` (tokens, or a mapping with `_BATCH_KEYS`) and the keyword
        arguments `given` (segment_ids, positions, weights; None: not given)."""
        given = {name: given.get(name) for name in _BATCH_KEYS[1:]}
        if isinstance(batch, Mapping):
            unknown = sorted(set(batch) - set(_BATCH_KEYS))
            if unknown or "tokens" not in batch:
                raise BatchError(
                    f"{where}: a batch mapping with keys {sorted(batch)}; expected 'tokens' and any of "
                    f"{list(_BATCH_KEYS[1:])} (unknown: {unknown})."
                )
            for name, value in given.items():
                if value is not None and name in batch:
                    raise BatchError(
                        f"{where}({name}=...): given both as an argument and in the batch mapping; "
                        "give it once."
                    )
                if value is None:
                    given[name] = batch.get(name)
            batch = batch["tokens"]
        _check_tokens(batch, where)
        if not jnp.issubdtype(batch.dtype, jnp.integer):
            raise BatchError(f"{where}: tokens of dtype {batch.dtype}; expected integer token ids.")
        positions = given.get("positions")
        # The model reads positions[:, :-1] (its inputs'), so only those are bounded.
        packing = _Packing.check(
            model.config,
            batch,
            given.get("segment_ids"),
            positions,
            given.get("weights"),
            where,
        )
        if positions is not None:
            _Packing.check_positions(model.config, positions[:, :-1], where)
        weights = packing.weights
        if weights is not None and not isinstance(weights, jax.core.Tracer):
            if not bool(jnp.any(weights[:, 1:] != 0)):
                raise BatchError(
                    f"{where}(weights=...): every target's weight is 0 (weights[:, 1:], shape "
                    f"{tuple(weights[:, 1:].shape)}), so the loss is a mean over no token. Give a "
                    "nonzero weight to the tokens to train on (1 for a target, 0 for a prompt or "
                    "padding), or leave such a batch out."
                )
        return cls(batch, packing)

    @property
    def weighted(self) -> bool:
        """Whether the loss is a weighted mean: weights given, or segment ids (whose
        boundaries leave the predictions that cross them out)."""
        return self.packing.weights is not None or self.packing.segment_ids is not None

    def inputs(self) -> tuple[Array, dict[str, Array]]:
        """The model's inputs: `tokens[:, :-1]`, and the stack's keyword arguments
        (segment ids and positions of those tokens) with the positions."""
        p = self.packing
        kw = {}
        if p.segment_ids is not None:
            kw["segment_ids"] = p.segment_ids[:, :-1]
        if p.positions is not None:
            kw["positions"] = p.positions[:, :-1]
        return self.tokens[:, :-1], kw

    def target_weights(self) -> Array:
        """The float32 weight of each prediction `(batch, seq)`: `weights[:, 1:]`
        (1 where not given), 0 where the target starts another segment than its
        input's (a prediction across a document boundary)."""
        p = self.tokens[:, 1:]
        w = jnp.ones(p.shape, jnp.float32)
        if self.packing.weights is not None:
            w = self.packing.weights[:, 1:].astype(jnp.float32)
        seg = self.packing.segment_ids
        if seg is not None:
            w = jnp.where(seg[:, 1:] == seg[:, :-1], w, jnp.zeros((), jnp.float32))
        return w


def gpt_first(
    model: GPT, tokens: Int[Array, "batch seq_plus_1"] | Mapping[str, Array]
) -> Float[Array, "batch seq d_model"]:
    """The first pipeline piece of `lm_loss`: the embedding of `tokens[:, :-1]`.

    `lm_loss(m, t) == gpt_last(m, m.blocks(gpt_first(m, t), **gpt_stack_kwargs(t)), t)`;
    a pipeline engine runs `gpt_first` on the first stage, `model.blocks` over the
    stages and `gpt_last` on the last.

    **Arguments:** `model`; `tokens` `(batch, seq + 1)`, or a packed batch: a
    mapping with `"tokens"` and any of `"segment_ids"`, `"positions"`,
    `"weights"`, each `(batch, seq + 1)` (as `lm_loss` takes them).

    **Returns:** activations `(batch, seq', d_model)` (`seq'` the local sequence block
    under sequence parallelism in manual mode).

    Dense models only: an MoE model (`config.moe_every > 0`) raises `PlanError`
    (a pipeline would drop its auxiliary losses).

    ```python
    h = eqxpar.models.gpt_first(model, tokens)
    ```
    """
    _no_pipeline(model, "gpt_first")
    inputs, kw = _LossInputs.of(model, tokens, "gpt_first").inputs()
    return model.embed_tokens(inputs, positions=kw.get("positions"))


def gpt_stack_kwargs(batch: Int[Array, "batch seq_plus_1"] | Mapping[str, Array]) -> dict[str, Array]:
    """The keyword arguments the blocks of a pipelined GPT take for `batch`: the
    segment ids and positions of its inputs (`[:, :-1]`), for a packed batch
    mapping; `{}` for plain tokens. The `stack_kwargs` of
    `eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last,
    stack_kwargs=gpt_stack_kwargs)`.

    **Arguments:** `batch`: tokens `(batch, seq + 1)`, or a mapping as `lm_loss` takes.

    **Returns:** a dict with `"segment_ids"` and `"positions"` `(batch, seq)` where
    the batch has them.

    ```python
    model.blocks(gpt_first(model, batch), **gpt_stack_kwargs(batch))
    ```
    """
    if not isinstance(batch, Mapping):
        return {}
    return {k: batch[k][:, :-1] for k in ("segment_ids", "positions") if k in batch}


def gpt_last(
    model: GPT,
    h: Float[Array, "batch seq d_model"],
    tokens: Int[Array, "batch seq_plus_1"] | Mapping[str, Array],
) -> Float[Array, ""] | WeightedMean:
    """The last pipeline piece of `lm_loss`: final norm, head and the mean
    next-token cross-entropy of the blocks' output `h` against `tokens[:, 1:]`.

    A vocabulary-split head returns the whole sequence in every mode (under sequence
    parallelism it gathers it), so the labels are the whole `tokens[:, 1:]`; the
    logits stay split over the vocabulary and `eqxpar.nn.cross_entropy` reduces them
    without gathering. Where the plan's rules keep `"vocab"` whole, each device scores
    its own sequence block against the whole vocabulary, with no collective.

    With `config.loss_chunk` set, the final norm, the head and the cross-entropy run
    on that many positions of `h` at a time, in a rematerialised loop, so neither
    pass holds more than one chunk's logits (see `GPTConfig`).

    **Arguments:** `model`; `h` `(batch, seq', d_model)`; `tokens` `(batch, seq +
    1)`, or a packed batch mapping (as `gpt_first` takes).

    **Returns:** the mean loss over the batch's tokens (a scalar); for a batch
    with weights or segment ids an `eqxpar.train.WeightedMean` (as `lm_loss`).

    Dense models only, as `gpt_first`.

    ```python
    loss = eqxpar.models.gpt_last(model, model.blocks(gpt_first(model, tokens)), tokens)
    ```
    """
    _no_pipeline(model, "gpt_last")
    return _cross_entropy(model, h, _LossInputs.of(model, tokens, "gpt_last"))


def output_head(model: GPT) -> "nn.Unembed | nn.Embedding":
    """The layer whose output `model`'s logits are: the `Unembed`, or the
    `Embedding` when the embeddings are tied."""
    return model.embed if model.head is None else model.head


def token_losses(model: GPT, h: Array, labels: Array, chunk: int | None) -> Array:
    """The float32 next-token cross-entropy of every position of the blocks'
    output `h` against `labels` `(batch, seq)`, in the layout `nn.cross_entropy`
    returns (this device's part of the sequence where the head leaves it split);
    the final norm, the head and the log-softmax run `chunk` positions of `h` at a
    time (None, or at least `h`'s length: all at once)."""
    head = output_head(model)
    if chunk is None or chunk >= h.shape[1]:
        return nn.cross_entropy(model.logits(h), labels, head=head)
    tiled = vocab_tiled_losses(model.final_norm, head, h, labels, chunk)
    if tiled is not None:
        return tiled
    return chunked_token_losses(_norm_and_head, (model.final_norm, head), h, labels, chunk)


def _cross_entropy(model: GPT, h: Array, inputs: _LossInputs, *, per_row: bool = False) -> Any:
    head = output_head(model)
    split = head.vocab_split()
    per_token = token_losses(model, h, inputs.tokens[:, 1:], model.config.loss_chunk)
    if inputs.weighted:
        return _weighted_sums(per_token, inputs.target_weights(), split, head.axis, per_row=per_row)
    # A whole-vocabulary head under sequence parallelism scores only this device's
    # sequence block: average the blocks' means over the axis.
    if split:
        return jnp.mean(per_token, axis=1) if per_row else jnp.mean(per_token)
    return nn.sequence_mean(per_token, per_row=per_row)


def _weighted_sums(per_token: Array, weights: Array, split: bool, axis: str, *, per_row: bool) -> Any:
    """The weighted sums of the per-token losses, in their layout: this device's
    part of a context split; under sequence parallelism in manual mode, with a
    whole-vocabulary head, this device's sequence block (the sums are then added
    over the axis). Per row: each row's weighted mean (0 for a row that counts no
    token)."""
    weights = split_context(weights)
    if not split:
        weights = split_tensor_sequence(weights, axis=axis)
    ctx = nn.tensor_context(axis)
    over_blocks = not split and ctx.manual and ctx.sequence_parallel
    weights = constant_weight(weights)
    dims = 1 if per_row else None
    total = jnp.sum(weights * per_token, axis=dims)
    weight = jnp.sum(weights, axis=dims)
    if over_blocks:
        total, weight = jax.lax.psum(total, axis), jax.lax.psum(weight, axis)
    if per_row:
        return jnp.where(weight > 0, total / jnp.maximum(weight, 1e-30), jnp.zeros((), total.dtype))
    return WeightedMean(total, weight)


def _norm_and_head(layers: tuple[nn.RMSNorm | nn.LayerNorm, nn.Unembed | nn.Embedding], h: Array) -> Array:
    # `GPT.logits` with the layers passed in (for the chunked loss, which gathers them).
    norm, head = layers
    return head.attend(norm(h)) if isinstance(head, nn.Embedding) else head(norm(h))


def lm_loss(
    model: GPT,
    tokens: Int[Array, "batch seq_plus_1"] | Mapping[str, Array],
    *,
    # Shaped, with dimensions of their own: checked below, with an eqxpar error
    # that names the argument.
    segment_ids: Shaped[Array, "_batch _seq_plus_1"] | None = None,
    positions: Shaped[Array, "_batch _seq_plus_1"] | None = None,
    weights: Shaped[Array, "_batch _seq_plus_1"] | None = None,
    key: PRNGKeyArray | None = None,
    # Any: checked below, with an eqxpar error that names the value.
    per_row: Any = False,
) -> Float[Array, ""] | Float[Array, " batch"] | WeightedMean:
    """Next-token cross-entropy of `model` on `tokens`, the mean over every predicted token.

    Predicts `tokens[:, 1:]` from `tokens[:, :-1]`; a mean over the batch, so it is a
    valid `loss_fn` for `eqxpar.train.make_step` under any plan (sharded and
    accumulated steps equal the full-batch one).

    Packed rows and masked tokens: `segment_ids`, `positions` and `weights` are
    `(batch, seq + 1)`, aligned with `tokens` (as `eqxpar.data` packs them). The
    model reads `segment_ids[:, :-1]` and `positions[:, :-1]` (see
    `GPT.logits_and_aux`: no attention across segments, positions restarting per
    document); the prediction of `tokens[:, t]` counts with weight `weights[:,
    t]` (default 1; 0 leaves a prompt or padding token out), and not at all where
    `segment_ids[:, t] != segment_ids[:, t - 1]` (it would cross a document
    boundary). With `weights` or `segment_ids` the loss is the weighted mean
    `sum(w * loss) / sum(w)` over the whole batch, and `lm_loss` returns it as an
    `eqxpar.train.WeightedMean` (the two sums): every step (`make_step`,
    `make_value_and_grad`, `make_eval_step`, with accumulation, sharded,
    pipelined) adds the sums over the batch's parts and divides once, so the
    result is the whole batch's weighted mean, never an average of the parts'
    means. Call `.value()` for the number. The tokens may also come as one
    mapping, `{"tokens": ..., "segment_ids": ..., "positions": ..., "weights":
    ...}` (any of the last three), which is what a step passes a packed batch as.

    For an MoE model the auxiliary losses are added:
    `+ load_balance_coef * mean(aux.load_balance_loss) + router_z_coef *
    mean(aux.router_z_loss)`, the means over the MoE blocks. Those are statistics of
    the tokens a call sees: the whole batch's under every plan (the layer sums over
    the devices the tokens are split over, see `eqxpar.nn.MoE`), but a
    micro-batch's under `accumulate` (or a pipeline's micro-batches), which then
    averages per-micro-batch values. The z-loss, a mean over tokens, stays exact;
    the load-balance loss, a product of two batch means, does not, so its gradient
    is not the full batch's: the step warns (`eqxpar.AccumulationWarning`). In a
    weighted mean the auxiliary terms count once per unit of weight (the
    micro-batches' terms weighted by their weights).

    With `config.loss_chunk` set, the final norm, the head and the cross-entropy run
    that many sequence positions at a time (as in `gpt_last`): the same loss,
    without the whole `(batch, seq, vocab)` logits in memory.

    **Arguments:** `model` (a `GPT`); `tokens` `(batch, seq + 1)` integer ids (or a
    mapping, above); keyword-only `segment_ids`, `positions` (integers) and
    `weights` (float, int or bool), each `(batch, seq + 1)` (default None);
    `key` (keyword-only, default None): for the LoRA adapters' dropout, which
    `make_step` passes each step (without it, or without adapter dropout, none);
    `per_row` (keyword-only, default False): one loss per row, the (weighted) mean
    over its tokens (plus the auxiliary losses; 0 for a row whose weights are all
    0), for `make_eval_step(..., per_row=True)`.

    **Returns:** a float scalar (nats per token, plus the auxiliary losses); with
    `weights` or `segment_ids` an `eqxpar.train.WeightedMean`; with `per_row`,
    `(batch,)`.

    **Raises:** `eqxpar.BatchError` for packing inputs of another shape than the
    tokens', segment ids or positions that are not integers, and (where the arrays
    are concrete, not traced under `jit`) positions outside `0 .. max_seq_len - 1`
    or weights that are 0 for every target.

    ```python
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan)
    state, metrics = step(state, tokens)
    packed = {"tokens": tokens, "segment_ids": seg, "positions": pos, "weights": w}
    state, metrics = step(state, packed)            # the weighted mean over the batch
    ```
    """
    if not isinstance(per_row, bool):
        raise PlanError(f"lm_loss(per_row={per_row!r}): expected True or False.")
    inputs = _LossInputs.of(
        model, tokens, "lm_loss", segment_ids=segment_ids, positions=positions, weights=weights
    )
    c = model.config
    ids, kw = inputs.inputs()
    if not c.moe_every:
        h, _ = _run_blocks(model, model.embed_tokens(ids, positions=kw.get("positions")), key, kw)
        return _cross_entropy(model, h, inputs, per_row=per_row)
    h, aux = _run_blocks(model, model.embed_tokens(ids, positions=kw.get("positions")), key, kw)
    loss = _cross_entropy(model, h, inputs, per_row=per_row)
    # Coefficients of 0 leave their terms out (not even a zero times a value).
    # Per row, each row carries the batch's terms: their mean over rows is the same.
    terms = []
    if c.load_balance_coef:
        terms.append(c.load_balance_coef * jnp.mean(aux.load_balance_loss))
    if c.router_z_coef:
        terms.append(c.router_z_coef * jnp.mean(aux.router_z_loss))
    for term in terms:
        if isinstance(loss, WeightedMean):
            # Once per unit of weight: `value()` is the mean plus the term.
            loss = WeightedMean(loss.total + loss.weight.astype(loss.total.dtype) * term, loss.weight)
        else:
            loss = loss + term
    return loss
