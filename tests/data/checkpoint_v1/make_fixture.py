"""Make the version-1 checkpoints tests/test_checkpoint_v1.py restores.

Before commit 1cf3aa3 ("The plan owns the layer order") eqxpar's checkpoints
(format version 1) held a `Stacked` exactly as the model held it, and a model
trained under an interleaved or uneven pipeline held its stack in the pipeline's
order: the user reordered it by hand with `eqxpar.pipeline.to_pipeline_order`
before `train.init`, as the tests and examples of that time did. This script is
that code path, so it must run against the code of the commit just before,
1cf3aa3^ (it refuses newer code):

    git worktree add <old> 1cf3aa3^       # or: git archive 1cf3aa3^ | tar -x -C <old>
    PYTHONPATH=<old> .venv/bin/python tests/data/checkpoint_v1/make_fixture.py

It writes, beside itself, for each case of `CASES` (a `Tiny` regression model of
tests/_helpers.py, under an interleaved plan over pipe=2 with two chunks a
device):

- `<case>/1/`: the checkpoint of the train state after one AdamW step
  (`CheckpointManager(...).save(1, state, data_state={"step": 1})`);
- `expected.npz`: every array of that state by its path, `<case>/stored<path>` as
  the file holds it (the pipeline's order) and `<case>/natural<path>` with each
  stack put back in natural order by that code's own `from_pipeline_order`.

Made with the repository's .venv (jax, orbax-checkpoint as pinned there).
"""

import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).parent
# (layers, stage_layers) of each case: equal stages, where the pipeline's order
# permutes the layers only (the file's shapes are those of a natural stack), and
# uneven ones, where it also pads each chunk to the largest stage.
CASES = {"interleaved": (4, None), "uneven": (5, (1, 2, 1, 1))}
STAGES, CHUNKS, MICROBATCHES, ROWS = 2, 2, 4, 8


def main() -> None:
    from tests._compile_flags import DEVICES_8, IN_ORDER, suite_xla_flags

    os.environ["XLA_FLAGS"] = suite_xla_flags(DEVICES_8, IN_ORDER)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    import eqxpar
    import eqxpar.checkpoint
    from tests._helpers import Tiny, pipeline_plan, regression_batch, tiny_loss

    if hasattr(eqxpar.nn, "in_natural_order"):
        sys.exit(
            f"{eqxpar.__file__} is eqxpar from 1cf3aa3 or later, which saves stacks in natural order. "
            "Run this script against 1cf3aa3^ (see its docstring)."
        )

    def paths_and_arrays(tree):
        flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
        out = {}
        for path, leaf in flat:
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(leaf))
        return out

    def is_stack(x):
        return isinstance(x, eqxpar.nn.Stacked)

    def in_natural_order(tree, order):
        """The model's stack and the optimizer moments' stacks back in natural order."""
        return jax.tree.map(
            lambda x: eqxpar.pipeline.from_pipeline_order(x, **order) if is_stack(x) else x,
            tree,
            is_leaf=is_stack,
        )

    expected = {}
    for case, (layers, stage_layers) in CASES.items():
        plan = pipeline_plan(
            "interleaved", pipe=STAGES, microbatches=MICROBATCHES, chunks=CHUNKS, stage_layers=stage_layers
        )
        order = dict(stages=STAGES, chunks=CHUNKS, stage_layers=stage_layers)
        model = Tiny(layers, key=jax.random.key(0))
        # As users did then: the stack reordered by hand into the pipeline's order.
        stored = eqx.tree_at(
            lambda m: m.blocks, model, eqxpar.pipeline.to_pipeline_order(model.blocks, **order)
        )
        optim = optax.adamw(1e-2)
        state = eqxpar.train.init(stored, optim, plan, key=jax.random.key(1))
        state, _ = eqxpar.train.make_step(tiny_loss(), optim, plan)(state, regression_batch(ROWS))
        directory = HERE / case
        shutil.rmtree(directory, ignore_errors=True)
        with eqxpar.checkpoint.CheckpointManager(directory) as manager:
            manager.save(1, state, data_state={"step": 1})
        # orbax notes there the absolute path it wrote to; it reads them only on
        # cloud storage, and a fixture names nothing outside the repository.
        for note in directory.rglob("commit_success.txt"):
            note.unlink()
        natural = in_natural_order(state, order)
        expected |= {f"{case}/stored{p}": x for p, x in paths_and_arrays(state).items()}
        expected |= {f"{case}/natural{p}": x for p, x in paths_and_arrays(natural).items()}
    np.savez_compressed(HERE / "expected.npz", **expected)
    print(f"wrote {', '.join(CASES)} and expected.npz ({len(expected)} arrays) in {HERE}")


if __name__ == "__main__":
    main()
