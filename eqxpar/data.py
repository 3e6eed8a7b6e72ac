"""Feeding a multi-process run: each process's rows, assembled into global batches.

```python
it = eqxpar.data.ShardedIterator((x, y), plan, batch_size=64, seed=0)
batch = eqxpar.data.global_batch(next(it), plan)      # global arrays, batch_spec
state, metrics = step(state, batch)
tokens = eqxpar.data.TokenFile("train.bin", seq_len=1024, dtype=np.uint16)   # on disk, memory-mapped
it = eqxpar.data.ShardedIterator(tokens, plan, batch_size=64, seed=0)        # reads only this process's rows
packed = eqxpar.data.PackedTokens(tokens, eod_id=50256)                      # documents packed into rows
it = eqxpar.data.ShardedIterator(packed, plan, batch_size=64, seed=0)        # dicts: tokens, segment_ids, ...
```
"""

from .runtime._data import ShardedIterator as ShardedIterator
from .runtime._data import global_batch as global_batch
from .runtime._data import process_slice as process_slice
from .runtime._grain import GrainSampler as GrainSampler
from .runtime._grain import grain_loader as grain_loader
from .runtime._grain import grain_sampler as grain_sampler
from .runtime._packed_tokens import PackedTokens as PackedTokens
from .runtime._token_file import TokenFile as TokenFile
