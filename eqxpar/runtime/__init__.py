"""Running across processes: launching them, joining them into one JAX run,
feeding them data, and checkpointing what they train.

This is the implementation package of the public modules `eqxpar.launch`,
`eqxpar.distributed`, `eqxpar.data` and `eqxpar.checkpoint`; each public name has
one path, under the module a script imports it from, so this package exports only
what belongs to none of them:

- `_launch`: `run` and `free_port` (`eqxpar.launch`; `python -m eqxpar.launch` is
  the command line);
- `_distributed`: `initialize`, `restart_count`, process-aware printing and logging
  (`eqxpar.distributed`);
- `_preemption`: `PreemptionGuard`, stopping every process at the same step on
  SIGTERM (`eqxpar.distributed`);
- `_data`: `ShardedIterator`, `global_batch`, `process_slice` (`eqxpar.data`);
- `_token_file`: `TokenFile`, token ids on disk read as sequences (`eqxpar.data`);
- `_packed_tokens`: `PackedTokens`, documents packed into rows with segment ids,
  positions and loss weights (`eqxpar.data`), from `_documents` (finding the
  documents in flat ids) and `_packing` (laying them into rows from their lengths);
- `_grain`: `GrainSampler`, `grain_sampler`, `grain_loader` (`eqxpar.data`; grain
  is imported only when a sampler's shard options or a loader are built);
- `_checkpoint`: `CheckpointManager` (`eqxpar.checkpoint`; orbax-checkpoint is
  imported only when a manager is built);
- `_xla_flags`: `supported_xla_flags`, the XLA flags the installed jaxlib knows
  (exported here).
"""

from ._xla_flags import supported_xla_flags as supported_xla_flags
