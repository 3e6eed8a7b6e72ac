"""Where each array of a `GPT` lives in a Hugging Face checkpoint, and how to read
any block of it (one device's slice) from the tensors there, or write them back.

A leaf's dimensions are of two kinds. *Enumerating* dimensions pick a tensor: the
stacked layer axis (`model.layers.{i}....`), the experts of an MoE layer, SwiGLU's
gate/up pair. The others are the tensor's own dimensions, after a reshape and a
transpose: Hugging Face's `q_proj.weight` `(heads * head_dim, d_model)` is split
into factors `(heads, head_dim)` and `(d_model,)` and permuted to eqxpar's
`(d_model, heads, head_dim)`. A block of the leaf then maps to one block of each
tensor it enumerates (whole rows of the outer factor; an inner factor cut is read
whole and sliced after), so a device reads only its layers and its rows.
"""

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

from ._gpt import GPTConfig
from ._hf_files import TensorFiles

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Source:
    """How one eqxpar leaf is stored: `name(*enumerated indices)` is the tensor's
    name; `enum` the leaf dimensions that enumerate tensors; `factors[d]` the
    split of the tensor's dimension `d`; `perm[t]` the free factor (not in `fixed`)
    that is the leaf's `t`-th tensor dimension; `fixed` pairs (factor, index) of
    factors this leaf takes one entry of (GPT-2's fused `c_attn.bias`); `zeros`:
    no tensor (a leaf Hugging Face does not have, read as zeros)."""

    name: Callable[..., str]
    enum: tuple[int, ...] = ()
    factors: tuple[tuple[int, ...], ...] = ()
    perm: tuple[int, ...] = ()
    fixed: tuple[tuple[int, int], ...] = ()
    zeros: bool = False

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(f) for f in self.factors)

    def names(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
        """Every (enumerated indices, tensor name) of a leaf of `shape`."""
        if self.zeros:
            return []
        combos = itertools.product(*(range(shape[d]) for d in self.enum))
        return [(combo, self.name(*combo)) for combo in combos]

    def read(self, files: TensorFiles, shape: tuple[int, ...], index: tuple[Range, ...], dtype) -> np.ndarray:
        """The block `index` (a (start, stop) per dimension) of the leaf, from disk."""
        out = np.zeros([b - a for a, b in index], dtype)
        if self.zeros:
            return out
        tensor_index = [r for d, r in enumerate(index) if d not in self.enum]
        for combo in itertools.product(*(range(*index[d]) for d in self.enum)):
            block = self._read_tensor(files, self.name(*combo), tensor_index)
            where = tuple(
                combo[self.enum.index(d)] - index[d][0] if d in self.enum else slice(None)
                for d in range(len(shape))
            )
            out[where] = block
        return out

    def _factor_ranges(self, tensor_index: list[Range]) -> list[Range]:
        fixed = dict(self.fixed)
        sizes = [f for dim in self.factors for f in dim]
        free = [p for p in range(len(sizes)) if p not in fixed]
        ranges: list[Range] = [(0, 0)] * len(sizes)
        for p, k in fixed.items():
            ranges[p] = (k, k + 1)
        for t, j in enumerate(self.perm):
            ranges[free[j]] = tensor_index[t]
        return ranges

    def _read_tensor(self, files: TensorFiles, name: str, tensor_index: list[Range]) -> np.ndarray:
        ranges = self._factor_ranges(tensor_index)
        hf_index, view, cut, p = [], [], [], 0
        for dim in self.factors:
            inner = math.prod(dim[1:])
            (a, b), rest = ranges[p], ranges[p + 1 : p + len(dim)]
            # Whole rows of the outer factor: a contiguous read; inner cuts after.
            hf_index.append(slice(a * inner, b * inner))
            view += [b - a, *dim[1:]]
            cut += [slice(None)] + [slice(*r) for r in rest]
            p += len(dim)
        block = files.read(name, tuple(hf_index)).reshape(view)[tuple(cut)]
        free_axes = [q for q in range(len(view)) if q not in dict(self.fixed)]
        block = block.reshape([block.shape[q] for q in free_axes])
        return np.transpose(block, self.perm)

    def place(self, target: np.ndarray, part: np.ndarray) -> None:
        """Write `part` (the leaf at one enumerated index) into its tensor `target`."""
        sizes = [f for dim in self.factors for f in dim]
        fixed = dict(self.fixed)
        view = target.reshape(sizes)
        free_part = np.transpose(part, np.argsort(self.perm))
        # Fixed factors are indexed away, so the rest line up with free_part's axes.
        view[tuple(fixed.get(p, slice(None)) for p in range(len(sizes)))] = free_part


def layout(config: GPTConfig, kind: str, prefix: str = "") -> dict[str, Source]:
    """The `Source` of every array leaf of `GPT(config)`, keyed by its path
    (`jax.tree_util.keystr`), for Hugging Face architecture `kind`."""
    c = config
    d, h, kv, hd, f = c.d_model, c.num_heads, c.num_kv_heads or c.num_heads, c.head_dim, c.d_hidden
    if kind == "gpt2":
        return _gpt2(c, prefix, d, h, hd, f)
    block = ".blocks.blocks.moe" if c.moe_every else ".blocks.blocks"

    def per_layer(suffix: str, factors, perm, enum=(0,)) -> Source:
        return Source(lambda i, *e: f"model.layers.{i}.{suffix}".format(*e), enum, factors, perm)

    out = {
        ".embed.weight": Source(lambda: "model.embed_tokens.weight", (), ((c.vocab_size,), (d,)), (0, 1)),
        ".final_norm.weight": Source(lambda: "model.norm.weight", (), ((d,),), (0,)),
        f"{block}.norm1.weight": per_layer("input_layernorm.weight", ((d,),), (0,)),
        f"{block}.norm2.weight": per_layer("post_attention_layernorm.weight", ((d,),), (0,)),
        f"{block}.attn.wq": per_layer("self_attn.q_proj.weight", ((h, hd), (d,)), (2, 0, 1)),
        f"{block}.attn.wk": per_layer("self_attn.k_proj.weight", ((kv, hd), (d,)), (2, 0, 1)),
        f"{block}.attn.wv": per_layer("self_attn.v_proj.weight", ((kv, hd), (d,)), (2, 0, 1)),
        f"{block}.attn.wo": per_layer("self_attn.o_proj.weight", ((d,), (h, hd)), (1, 2, 0)),
    }
    if not c.tied:
        out[".head.weight"] = Source(lambda: "lm_head.weight", (), ((c.vocab_size,), (d,)), (1, 0))
    if c.use_bias if c.qkv_bias is None else c.qkv_bias:
        for leaf, proj, heads in (("bq", "q", h), ("bk", "k", kv), ("bv", "v", kv)):
            out[f"{block}.attn.{leaf}"] = per_layer(f"self_attn.{proj}_proj.bias", ((heads, hd),), (0, 1))
    if c.use_bias:
        out[f"{block}.attn.bo"] = per_layer("self_attn.o_proj.bias", ((d,),), (0,))
    if c.moe_every:
        moe = "block_sparse_moe"
        out[f"{block}.mlp.router"] = per_layer(f"{moe}.gate.weight", ((c.experts,), (d,)), (1, 0))
        out[f"{block}.mlp.router_bias"] = Source(lambda *_: "", zeros=True)
        # Mixtral's expert: w2(silu(w1 x) * w3 x); eqxpar's: w_out(silu(x w_gate) * x w_in).
        for leaf, w in (("w_gate", "w1"), ("w_in", "w3")):
            out[f"{block}.mlp.{leaf}"] = per_layer(
                f"{moe}.experts.{{}}.{w}.weight", ((f,), (d,)), (1, 0), enum=(0, 1)
            )
        out[f"{block}.mlp.w_out"] = per_layer(
            f"{moe}.experts.{{}}.w2.weight", ((d,), (f,)), (1, 0), enum=(0, 1)
        )
    else:
        # w_in (d, 2, hidden): index 0 is the gate (under silu), 1 the up projection.
        out[f"{block}.mlp.w_in"] = Source(
            lambda i, k: f"model.layers.{i}.mlp.{('gate_proj', 'up_proj')[k]}.weight",
            (0, 2),
            ((f,), (d,)),
            (1, 0),
        )
        out[f"{block}.mlp.w_out"] = per_layer("mlp.down_proj.weight", ((d,), (f,)), (1, 0))
        if c.use_bias:
            out[f"{block}.mlp.b_in"] = Source(
                lambda i, k: f"model.layers.{i}.mlp.{('gate_proj', 'up_proj')[k]}.bias", (0, 1), ((f,),), (0,)
            )
            out[f"{block}.mlp.b_out"] = per_layer("mlp.down_proj.bias", ((d,),), (0,))
    return out


def _gpt2(c: GPTConfig, prefix: str, d: int, h: int, hd: int, f: int) -> dict[str, Source]:
    def per_layer(suffix: str, factors, perm, enum=(0,), fixed=()) -> Source:
        return Source(lambda i, *_: f"{prefix}h.{i}.{suffix}", enum, factors, perm, fixed)

    def whole(name: str, factors, perm) -> Source:
        return Source(lambda: f"{prefix}{name}", (), factors, perm)

    b = ".blocks.blocks"
    # GPT-2's Conv1D stores (in, out): eqxpar's own orientation, no transpose.
    out = {
        ".embed.weight": whole("wte.weight", ((c.vocab_size,), (d,)), (0, 1)),
        ".positions": whole("wpe.weight", ((c.max_seq_len,), (d,)), (0, 1)),
        ".final_norm.weight": whole("ln_f.weight", ((d,),), (0,)),
        ".final_norm.bias": whole("ln_f.bias", ((d,),), (0,)),
        f"{b}.attn.wqkv": per_layer("attn.c_attn.weight", ((d,), (3, h, hd)), (0, 1, 2, 3)),
        f"{b}.attn.wo": per_layer("attn.c_proj.weight", ((h, hd), (d,)), (0, 1, 2)),
        f"{b}.attn.bo": per_layer("attn.c_proj.bias", ((d,),), (0,)),
        # n_in = 1 for GELU: the leaf's (d, 1, hidden) enumerates one tensor.
        f"{b}.mlp.w_in": per_layer("mlp.c_fc.weight", ((d,), (f,)), (0, 1), enum=(0, 2)),
        f"{b}.mlp.b_in": per_layer("mlp.c_fc.bias", ((f,),), (0,), enum=(0, 1)),
        f"{b}.mlp.w_out": per_layer("mlp.c_proj.weight", ((f,), (d,)), (0, 1)),
        f"{b}.mlp.b_out": per_layer("mlp.c_proj.bias", ((d,),), (0,)),
    }
    for n, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
        out[f"{b}.{n}.weight"] = per_layer(f"{ln}.weight", ((d,),), (0,))
        out[f"{b}.{n}.bias"] = per_layer(f"{ln}.bias", ((d,),), (0,))
    for k, leaf in enumerate(("bq", "bk", "bv")):
        out[f"{b}.attn.{leaf}"] = per_layer("attn.c_attn.bias", ((3, h, hd),), (0, 1), fixed=((0, k),))
    if not c.tied:
        out[".head.weight"] = Source(lambda: "lm_head.weight", (), ((c.vocab_size,), (d,)), (1, 0))
    return out
