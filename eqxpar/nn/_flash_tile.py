"""One tile of flash attention: the arithmetic `blockwise_attention`
(`_blockwise.py`) and context attention's tile kernel (`_attention_tiles.py`)
share. A tile is a block of queries against a block of keys; scores are
`(b, hkv, g, q, s)` for grouped queries `(b, q, hkv, g, d)` (query head
`k * g + i` reads key/value head `k`) and keys/values `(b, s, hkv, d)`.

Forward: `fold_tile` folds a tile into a float32 online softmax (running
maximum and sum per query). Backward: `value_and_score_grads` and
`query_and_key_grads` give the tile's dV, dS, dQ and dK from its recomputed
probabilities (FlashAttention's backward; with dropout `Z`, `O = (P * Z) V`).

What stays with each caller: where the `1/sqrt(d)` scale is applied (blockwise
scales the scores, context attention the queries once), how the probabilities
are recomputed (blockwise from the running maximum and sum, keeping padding out
but masked keys in, as dense attention does for a fully masked row; context
attention from the log-sum-exp) and the loop over key blocks. Sharing those
would change the results' rounding.
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TileOptions:
    """The static options of a loop over tiles, passed as one argument (and one
    hashable `nondiff_argnums` entry of a custom VJP): `causal` (keys at global
    positions after the query's take no weight), `block_size` (keys per tile) and
    `dropout_rate` (0: no dropout)."""

    causal: bool
    block_size: int
    dropout_rate: float


def accumulation_dtype(dtype) -> jnp.dtype:
    """The dtype attention accumulates in: at least float32 (bfloat16 inputs), and
    float64 for float64 inputs (under `jax_enable_x64`), as one device computes."""
    return jnp.promote_types(dtype, _F32)


def key_blocks(x: Array, block: int, dtype) -> tuple[Array, int]:
    """Keys or values `(b, L, h, d)` as `dtype` in blocks `(nb, b, block, h, d)`,
    padded with zeros to whole blocks, and `nb`."""
    b, length, h, d = x.shape
    nb = -(-length // block)
    x = jnp.pad(x.astype(dtype), ((0, 0), (0, nb * block - length), (0, 0), (0, 0)))
    return x.reshape(b, nb, block, h, d).swapaxes(0, 1), nb


def empty_softmax_state(qg: Array) -> tuple[Array, Array, Array]:
    """The online softmax of the grouped queries `qg` `(b, q, hkv, g, d)` before any
    key: (acc `(b, hkv, g, q, d)` zeros, running max `-inf`, running sum 0). Built
    from `qg` (zeros_like) so that inside `shard_map` it varies like `qg`."""
    acc = jnp.zeros_like(qg).transpose(0, 2, 3, 1, 4)
    return acc, jnp.full_like(acc[..., 0], -jnp.inf), jnp.zeros_like(acc[..., 0])


def tile_scores(qg: Array, kj: Array) -> Array:
    """`(b, hkv, g, q, s)`: the grouped queries `qg` `(b, q, hkv, g, d)` dotted with
    the keys `kj` `(b, s, hkv, d)` (unscaled, unmasked)."""
    return jnp.einsum("bqkgd,bskd->bkgqs", qg, kj)


def fold_tile(state: tuple, s: Array, keep: Array, vj: Array, drop: Array | None = None) -> tuple:
    """One online-softmax step: fold a tile of scores `s` `(b, hkv, g, q, s)` (masked
    entries at `finfo(float32).min`) and its values `vj` `(b, s, hkv, d)` into
    `state` = (acc, running max, running sum); keys where `keep` is False take no
    weight. `drop` (dropout's `keep / (1 - rate)`, like `s`) scales the
    probabilities the output accumulates, not those the running sum normalises by."""
    acc, m, total = state
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(keep, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    total = total * corr + p.sum(-1)
    pv = p if drop is None else p * drop
    acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", pv, vj)
    return acc, m_new, total


def value_and_score_grads(
    p: Array, drop: Array | None, do: Array, vj: Array, delta: Array
) -> tuple[Array, Array]:
    """A tile's dV `(b, s, hkv, d)` and dS `(b, hkv, g, q, s)` (the gradient of its
    scores, before any mask or scale) from its probabilities `p`, dropout scale
    `drop` (None without), the output's cotangent `do` `(b, q, hkv, g, d)`, the
    values `vj` and `delta` = rowsum(dO * O) `(b, hkv, g, q)` of the (dropped)
    output. With dropout `Z`: dV = (P * Z)^T dO, dP = (dO V^T) * Z, and
    dS = P * (dP - delta) as without."""
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p if drop is None else p * drop, do)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do, vj)
    dp = dp if drop is None else dp * drop
    return dv, p * (dp - delta[..., None])


def query_and_key_grads(ds: Array, qg: Array, kj: Array) -> tuple[Array, Array]:
    """A tile's dQ `(b, q, hkv, g, d)` (to add over key blocks) and dK `(b, s, hkv,
    d)` from its score gradient `ds` (masked and scaled as the scores were)."""
    return jnp.einsum("bkgqs,bskd->bqkgd", ds, kj), jnp.einsum("bkgqs,bqkgd->bskd", ds, qg)
