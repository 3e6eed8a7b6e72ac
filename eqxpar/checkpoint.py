"""Sharded, asynchronous, atomic checkpoints of a train state (needs `eqxpar[checkpoint]`).

```python
manager = eqxpar.checkpoint.CheckpointManager("ckpt", max_to_keep=3)
manager.save(int(state.step), state, data_state=iterator.get_state())
state, data_state = manager.restore(like=state, plan=plan)   # any mesh, any plan
```

orbax-checkpoint is imported only when a manager is built, so `import eqxpar`
works without it.
"""

from .runtime._checkpoint import CheckpointError as CheckpointError
from .runtime._checkpoint import CheckpointManager as CheckpointManager
