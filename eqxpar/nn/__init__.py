"""Tensor-parallel Equinox layers.

Every layer declares logical axes on its weights (`"embed"`, `"mlp"`, `"heads"`,
`"kv_heads"`, `"vocab"`) and runs unchanged under automatic sharding (it only
constrains activations) and inside `shard_map` over its tensor axis (it issues its
own collectives: synchronous, or ring collective matmuls with the plan's
`tp_overlap`), with or without sequence parallelism (the plan's
`sequence_parallel`). Activations are batch-first `(batch, seq, features)`.
"""

from .._stack_order import in_natural_order as in_natural_order
from .._stack_order import in_plan_order as in_plan_order
from ._attention import Attention as Attention
from ._attention_config import AttentionConfig as AttentionConfig
from ._block import TransformerBlock as TransformerBlock
from ._block_config import BlockConfig as BlockConfig
from ._blockwise import blockwise_attention as blockwise_attention
from ._context import TensorContext as TensorContext
from ._context import tensor_context as tensor_context
from ._context_attention import context_attention as context_attention
from ._dropout import Dropout as Dropout
from ._linear import MLP as MLP
from ._linear import ColumnLinear as ColumnLinear
from ._linear import RowLinear as RowLinear
from ._lora import AttentionLoRA as AttentionLoRA
from ._lora import MLPLoRA as MLPLoRA
from ._moe import MoE as MoE
from ._moe import MoEAux as MoEAux
from ._moe import update_router_bias as update_router_bias
from ._moe_config import MoEConfig as MoEConfig
from ._norm import LayerNorm as LayerNorm
from ._norm import RMSNorm as RMSNorm
from ._pool import first_token as first_token
from ._pool import mean_pool as mean_pool
from ._rotary import RotaryScaling as RotaryScaling
from ._rotary import apply_rotary as apply_rotary
from ._sequence import sequence_mean as sequence_mean
from ._sequence import split_sequence as split_sequence
from ._sequence_layout import context_layout as context_layout
from ._sequence_layout import context_positions as context_positions
from ._sequence_layout import context_unlayout as context_unlayout
from ._stack import Stacked as Stacked
from ._vocab import Embedding as Embedding
from ._vocab import Unembed as Unembed
from ._vocab import cross_entropy as cross_entropy
