"""The actions of a pipeline schedule: their codes, names and unit costs, and
what each waits for. Shared with `eqxpar._advise` (which reads the engine's
program) and the tests: internal names, not public API (`ACTION_NAMES` and
`COSTS` are readable as `eqxpar.internal.ACTION_NAMES` and `.COSTS`).

A schedule table holds one action per device and tick (`Schedule.table[..., 2]`);
an action waits for the actions whose activation or cotangent it takes, sent at
the end of their tick and usable from the next.
"""

import typing

#: Action codes in `Schedule.table[..., 2]`.
IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = 0, 1, 2, 3, 4
ACTION_NAMES = ("idle", "forward", "backward", "backward-input", "backward-weight")
#: One-letter names used by the text rendering and the picture.
ACTION_LETTERS = (".", "F", "B", "I", "W")
#: The cost model of the bubble fractions: a backward pass costs two forwards; its
#: halves (input gradient, weight gradient) one each.
COSTS = (0, 1, 2, 1, 1)

Action = tuple[int, int, int]  # (action, micro-batch, chunk)


# Hot: the schedule simulator calls these once per action and dependency
# (millions of times over the suite); `no_type_check` keeps jaxtyping's
# per-call signature binding off them.
@typing.no_type_check
def dependencies(action: Action, k: int, stages: int) -> list[tuple[int, int, int]]:
    """(action kinds, micro-batch, virtual stage) an action waits for, as
    (kind, mb, stage) with kind -1 meaning "B or I"."""
    kind, mb, _ = action
    if kind == FORWARD:
        return [(FORWARD, mb, k - 1)] if k > 0 else []
    if kind in (BACKWARD, BACKWARD_INPUT):
        deps = [(FORWARD, mb, k)]
        if k < stages - 1:
            deps.append((-1, mb, k + 1))
        return deps
    if kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, mb, k)]
    return []


@typing.no_type_check
def done_key(kind: int, mb: int, k: int) -> tuple[int, int, int]:
    """The key an action's completion is recorded under: B and I both produce
    the cotangent the previous stage waits for, so both record kind -1."""
    return (-1 if kind in (BACKWARD, BACKWARD_INPUT) else kind, mb, k)


def describe(kind: int, mb: int, k: int) -> str:
    """The action `(kind, mb, k)` in words (kind -1: "B or I", see `done_key`)."""
    if kind == -1:
        return f"the backward (or backward-input) of micro-batch {mb} at virtual stage {k}"
    return f"the {ACTION_NAMES[kind]} of micro-batch {mb} at virtual stage {k}"
