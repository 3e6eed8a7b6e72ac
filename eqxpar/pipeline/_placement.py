"""Where virtual stages live: which device runs which virtual stage.

With `p` devices and `v` chunks per device there are `S = p * v` virtual
stages. Placement `"interleaved"` (the engine's): virtual stage `k` runs on
device `k % p` as its chunk `k // p` (Megatron's layout: an activation always
moves to the next device, wrapping from the last device to the first for the
next chunk). Placement `"v"` (ZB-V, DualPipeV): chunk `c` of device `d` is
virtual stage `c * p + d` for even `c` and `c * p + p - 1 - d` for odd `c`, so
with two chunks device `d` holds stages `d` and `2p - 1 - d` and the
activations go down the devices and back up. V tables are for prediction
(`simulate`, bubble fractions); the engine runs the interleaved placement only.
"""

#: Where virtual stages live (see the module docstring).
PLACEMENTS = ("interleaved", "v")


def virtual_stage_of(device: int, chunk: int, p: int, placement: str) -> int:
    """Virtual stage of `chunk` on `device`."""
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - device
    return chunk * p + device


def device_of(k: int, p: int, placement: str) -> int:
    """Device that runs virtual stage `k`."""
    chunk, r = divmod(k, p)
    return p - 1 - r if placement == "v" and chunk % 2 else r
