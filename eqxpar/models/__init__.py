"""Reference models built only from `eqxpar.nn` layers.

Each runs unchanged under every plan: one device, automatic data / FSDP / tensor
parallelism, and manual tensor-parallel steps.

- `MLPClassifier`: column/row-parallel MLP pairs over feature vectors.
- `GPT` (`GPTConfig`): a pre-norm decoder with rotary or learned positions,
  SwiGLU or GELU MLPs, RMSNorm or LayerNorm, optional biases and fused QKV, tied or
  untied embeddings and its blocks in one scanned `eqxpar.nn.Stacked`; `lm_loss`,
  `token_logprobs`, `generate`, and the pipeline pieces `gpt_first` / `gpt_last`. With
  `GPTConfig(moe_every=k, experts=n)` every k-th block is a mixture of experts
  (the stack holds `MoEGroup`s) and `lm_loss` adds the auxiliary losses.
  `preset(name)` gives published shapes (`"gpt2"`, `"llama3-8b"`, `"llama3-70b"`,
  `"mixtral-8x7b"`) as `GPTConfig`s.
"""

from .._errors import PretrainedError as PretrainedError
from ._dpo import PolicyWithReference as PolicyWithReference
from ._dpo import dpo_loss as dpo_loss
from ._dpo import dpo_pipeline_loss as dpo_pipeline_loss
from ._dpo import preference_losses as preference_losses
from ._dpo import sequence_logprobs as sequence_logprobs
from ._flops import flops_per_token as flops_per_token
from ._flops import transformer_flops_per_token as transformer_flops_per_token
from ._generate import Generation as Generation
from ._generate import generate as generate
from ._generate import lower_generate as lower_generate
from ._gpt import GPT as GPT
from ._gpt import GPTConfig as GPTConfig
from ._gpt import MoEGroup as MoEGroup
from ._gpt import gpt_first as gpt_first
from ._gpt import gpt_last as gpt_last
from ._gpt import gpt_stack_kwargs as gpt_stack_kwargs
from ._gpt import lm_loss as lm_loss
from ._logprobs import token_logprobs as token_logprobs
from ._lora import add_lora as add_lora
from ._lora import lora_trainable as lora_trainable
from ._lora import merge_lora as merge_lora
from ._lora import without_lora as without_lora
from ._lora_peft import save_lora as save_lora
from ._mlp import MLPClassifier as MLPClassifier
from ._presets import PRESET_NAMES as PRESET_NAMES
from ._presets import preset as preset
from ._pretrained import from_pretrained as from_pretrained
from ._pretrained import save_pretrained as save_pretrained
