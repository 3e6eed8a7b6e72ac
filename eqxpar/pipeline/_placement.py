"""Where virtual stages live: which device runs which virtual stage, and which
way what one stage hands the next travels.

With `p` devices and `v` chunks per device there are `S = p * v` virtual
stages. Placement `"interleaved"`: virtual stage `k` runs on device `k % p` as
its chunk `k // p` (Megatron's layout: an activation always moves to the next
device, wrapping from the last device to the first for the next chunk).
Placement `"v"` (ZB-V, DualPipeV): chunk `c` of device `d` is virtual stage
`c * p + d` for even `c` and `c * p + p - 1 - d` for odd `c`, so with two
chunks device `d` holds stages `d` and `2p - 1 - d` and the activations go down
the devices and back up: device `p - 1` hands stage `p - 1`'s output to its own
stage `p` (the V's turn), and device 0 runs both the first and the last stage.

The engine moves values along three lanes (`lane`): `DOWN` (a send to the next
device along `pipe`, `d -> d + 1`), `UP` (to the previous one) and `LOCAL` (a
hand-over on the device itself, which sends nothing).
"""

import typing

#: Where virtual stages live (see the module docstring).
PLACEMENTS = ("interleaved", "v")

#: The lanes a value between stages moves along (see the module docstring).
DOWN, UP, LOCAL = 0, 1, 2
LANES = ("down", "up", "local")


# Hot: the schedule simulator calls these once per action and dependency
# (millions of times over the suite); `no_type_check` keeps jaxtyping's
# per-call signature binding off them (the two prediction tests of
# test_pipeline_simulate.py: 32 s -> 11 s).
@typing.no_type_check
def virtual_stage_of(device: int, chunk: int, p: int, placement: str) -> int:
    """Virtual stage of `chunk` on `device`."""
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - device
    return chunk * p + device


@typing.no_type_check
def device_of(k: int, p: int, placement: str) -> int:
    """Device that runs virtual stage `k`."""
    chunk, r = divmod(k, p)
    return p - 1 - r if placement == "v" and chunk % 2 else r


@typing.no_type_check
def lane(source: int, target: int, p: int, placement: str) -> int:
    """The lane (`DOWN`, `UP` or `LOCAL`) along which virtual stage `source`
    hands virtual stage `target = source +- 1` its activation (`target > source`)
    or cotangent. Decided by the direction of travel, not the two devices (with
    `p = 2` the next device is also the previous one)."""
    if device_of(source, p, placement) == device_of(target, p, placement):
        return LOCAL
    forward = target > source
    if placement == "v":
        # The edge lies within one chunk (the V's turn is local): an even chunk
        # runs down the devices, an odd one back up.
        forward = forward == ((min(source, target) // p) % 2 == 0)
    return DOWN if forward else UP
