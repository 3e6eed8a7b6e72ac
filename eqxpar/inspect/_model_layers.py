"""The `eqxpar.nn` layers of a model that `minimum_comm` counts by type:
attention layers (context parallelism) and mixture-of-experts layers (expert
parallelism). Shared with `eqxpar._advise` (which counts a model's attention
layers): internal names, not public API.
"""

from typing import Any

import jax


def moe_layers(tree: Any) -> list[Any]:
    """The `eqxpar.nn.MoE` modules in `tree`."""
    from ..nn._moe import MoE

    is_moe = lambda x: isinstance(x, MoE)  # noqa: E731
    return [x for x in jax.tree.leaves(tree, is_leaf=is_moe) if is_moe(x)]


def attention_layers(tree: Any) -> list[Any]:
    """The `eqxpar.nn.Attention` modules in `tree` (a model, or its specs)."""
    from ..nn._attention import Attention

    is_attention = lambda x: isinstance(x, Attention)  # noqa: E731
    return [x for x in jax.tree.leaves(tree, is_leaf=is_attention) if is_attention(x)]
