"""Context parallelism as layers see it: whether the sequence is split over the
`context` axis here, and a guard against attention fed a sequence nobody split.

A step splits the sequence over `context` only inside its manual region; layers
read that from the abstract mesh, as tensor-parallel layers read the tensor axis.
Inside the step, `expect_split()` is open: `note_split()` records that the ids
were cut to this device's part (`eqxpar.nn.split_sequence` does it), and
attention refuses to run on activations of a sequence that was never split,
which would otherwise attend within each device's copy of the whole sequence and
silently train on the wrong thing.
"""

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from ._errors import PlanError
from ._mesh import CONTEXT_AXIS
from ._plan import current_plan
from ._trace_notes import TraceNotes

# The keys attention met while `eqxpar.inspect.minimum_comm` traces a loss.
_KEYS = TraceNotes("eqxpar_attention_keys")
# [split seen?] for the step being traced, None outside one.
_SEEN: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "eqxpar_context_split", default=None
)


def context_size() -> int:
    """Devices the sequence is split over here: the size of the `context` axis
    when it is manual (inside a step, or the user's `shard_map` over it), else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT_AXIS not in mesh.manual_axes:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


def context_attention_impl() -> str:
    """The plan's `context_attention` (`"ring"`, `"allgather"` or `"ulysses"`); by
    default `"ring"`, or `"allgather"` in a pipeline (see `Plan(context_attention=...)`)."""
    from ._parallel_dims import ParallelDims

    plan = current_plan()
    return "ring" if plan is None else ParallelDims.of(plan).context_attention_run


def check_ulysses_heads(num_heads: int, tensor: int, n: int, where: str) -> None:
    """Raise, naming the fixes, when the `n` devices of the `context` axis cannot
    split the query heads left on each of `tensor` tensor devices under
    `Plan(context_attention="ulysses")` (every device attends to heads / n of them
    over the whole sequence)."""
    local = num_heads // tensor
    if local % n == 0:
        return
    split = (
        f"the {tensor} devices of the tensor axis leave {local} query heads per device, and "
        if tensor > 1
        else ""
    )
    raise PlanError(
        f"{where}: num_heads={num_heads} under Plan(context_attention='ulysses'): {split}Ulysses splits "
        f"{'those' if tensor > 1 else 'the query heads'} over the {n} devices of {CONTEXT_AXIS!r}, which "
        f"needs a multiple of {n}. Use num_heads a multiple of {n * tensor}, a {CONTEXT_AXIS!r} axis whose "
        f"size divides {local}, or context_attention='ring' / 'allgather' (no condition on the heads)."
    )


@contextlib.contextmanager
def expect_split() -> Iterator[None]:
    """While tracing a step's loss: attention checks that the sequence was split."""
    token = _SEEN.set([False])
    try:
        yield
    finally:
        _SEEN.reset(token)


def note_split() -> None:
    """Record that this step's sequence was cut to this device's part."""
    seen = _SEEN.get()
    if seen is not None:
        seen[0] = True


def check_context_split(where: str) -> None:
    """Raise if, inside a step splitting the sequence over `context`, nothing cut
    the sequence to this device's part before `where` needed it."""
    seen = _SEEN.get()
    if seen is not None and not seen[0]:
        raise PlanError(
            f"{where}: the mesh's {CONTEXT_AXIS!r} axis (size {context_size()}) splits the sequence, "
            "but the activations reaching attention were computed from the whole sequence on every "
            "device: attention would mix each device's copy with the others' parts. Cut the inputs to "
            "this device's part before the blocks: eqxpar.nn.Embedding does it for token ids, and "
            "eqxpar.nn.split_sequence(x) does it for any other input (patches, positions, labels)."
        )


def record_keys() -> contextlib.AbstractContextManager[list[jax.ShapeDtypeStruct]]:
    """Collect the shape of the keys every attention call traced inside sees."""
    return _KEYS.record()


def note_keys(k: jax.Array) -> None:
    """Attention's keys, `(batch, seq, kv_heads, head_dim)`, for `record_keys`."""
    _KEYS.note(k)
