"""The built-in schedules' orders: the sequence of actions each device runs.

One generator per schedule (`orders_gpipe`, `orders_1f1b_fused`,
`orders_interleaved`, `orders_zero_bubble`, `orders_zb_v`,
`orders_dualpipe_v`), each returning one order per device of `(action,
micro-batch, chunk)`; `_ticks.place_ticks` turns orders into a table.
"""

from ._actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import virtual_stage_of


def orders_gpipe(p: int, m: int) -> list[list[Action]]:
    return [[(FORWARD, j, 0) for j in range(m)] + [(BACKWARD, j, 0) for j in range(m)] for _ in range(p)]


def orders_1f1b_fused(p: int, m: int) -> list[list[Action]]:
    # 1F1B for fused ticks: device s warms up with 2 (p - 1 - s) forwards, then
    # alternates, each forward sharing a tick with a backward. A tick's backward
    # on device s then meets the next device's from the tick before, so in the
    # steady state every device runs one forward and one backward per tick.
    orders = []
    for s in range(p):
        warmup = min(2 * (p - 1 - s), m)
        order = [(FORWARD, j, 0) for j in range(warmup)]
        for i in range(m - warmup):
            order += [(FORWARD, warmup + i, 0), (BACKWARD, i, 0)]
        order += [(BACKWARD, j, 0) for j in range(m - warmup, m)]
        orders.append(order)
    return orders


def orders_interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    # Megatron-LM's interleaved 1F1B: forwards go p micro-batches at a time through
    # chunk 0, then the same p through chunk 1, ...; backwards in the same groups
    # from the last chunk down. Device s warms up with enough forwards to fill the
    # pipeline ahead of it, then alternates one forward and one backward.
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return mb, (v - 1 - chunk if backward else chunk)

    orders = []
    for s in range(p):
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        order: list[Action] = [(FORWARD, *unit(k, False)) for k in range(warmup)]
        for i in range(total - warmup):
            order += [(FORWARD, *unit(warmup + i, False)), (BACKWARD, *unit(i, True))]
        order += [(BACKWARD, *unit(k, True)) for k in range(total - warmup, total)]
        orders.append(order)
    # The last device runs the last virtual stage (and the model's head, in the
    # engine) fused with its forward in ticks where every other device runs a
    # forward and a backward: that tick lasts a head longer. Its last p - 1 such
    # backwards are split instead: the input half beside the forward (cheaper than
    # the others' pair), the weight half in the p - 1 ticks the device idles at
    # the end while the cotangents reach device 0 (cheaper than their backwards).
    # The weight halves keep their residuals and cotangent that long: p - 1 slots.
    last, split = orders[p - 1], set()
    for i in range(len(last) - 1, -1, -1):
        kind, mb, chunk = last[i]
        if kind == BACKWARD and chunk == v - 1 and len(split) < p - 1:
            last[i] = (BACKWARD_INPUT, mb, chunk)
            split.add(mb)
    last += [(BACKWARD_WEIGHT, mb, v - 1) for mb in sorted(split)]
    return orders


def orders_zero_bubble(p: int, m: int) -> list[list[Action]]:
    # ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward pass is
    # split into an input-gradient pass (I), which the previous stage waits for,
    # and a weight-gradient pass (W), which nobody waits for. A greedy list
    # schedule in unit ticks: each device runs, by priority, an I that is ready;
    # the oldest pending W once p - 1 of them wait; a forward while fewer than
    # 1F1B's p - s micro-batches wait for their I; else a pending W. Deferred W's
    # fill what would be 1F1B's bubble: with unit costs the bubble is
    # (p - 1) / (3m + p - 1), a third of 1F1B's, and a device holds at most
    # 2p - 1 stage inputs (a number set by the stages, not the micro-batches).
    next_f = [0] * p
    f_done: list[dict[int, int]] = [{} for _ in range(p)]  # mb -> tick
    i_done: list[dict[int, int]] = [{} for _ in range(p)]
    w_done = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    tick = 0
    while any(w < m for w in w_done):
        chosen: list[Action | None] = []
        for s in range(p):
            ready_i = [
                j
                for j in f_done[s]
                if j not in i_done[s]
                and f_done[s][j] < tick
                and (s == p - 1 or i_done[s + 1].get(j, tick) < tick)
            ]
            j = next_f[s]
            can_forward = (
                j < m
                and len(f_done[s]) - len(i_done[s]) < p - s
                and (s == 0 or f_done[s - 1].get(j, tick) < tick)
            )
            if ready_i:
                chosen.append((BACKWARD_INPUT, min(ready_i), 0))
            elif len(pending_w[s]) > p - 1:
                chosen.append((BACKWARD_WEIGHT, pending_w[s][0], 0))
            elif can_forward:
                chosen.append((FORWARD, j, 0))
            elif pending_w[s]:
                chosen.append((BACKWARD_WEIGHT, pending_w[s][0], 0))
            else:
                chosen.append(None)
        for s, act in enumerate(chosen):
            if act is None:
                continue
            kind, j, _ = act
            if kind == FORWARD:
                f_done[s][j] = tick
                next_f[s] += 1
            elif kind == BACKWARD_INPUT:
                i_done[s][j] = tick
                pending_w[s].append(j)
            else:
                pending_w[s].pop(0)
                w_done[s] += 1
            orders[s].append(act)
        tick += 1
    return orders


def orders_zb_v(p: int, m: int) -> list[list[Action]]:
    # ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", sec. 6): two chunks per
    # device in a V (device d runs virtual stages d and 2p-1-d), the backward split
    # into I and W. A greedy list schedule in unit ticks over the 2p virtual
    # stages: each device runs, by priority, a ready I (oldest micro-batch, later
    # stage first, so cotangents flow back at once); a W once 2p - 1 of them wait;
    # a ready forward (later stage first) while fewer than 2p chunk activations
    # (1F1B's peak of p whole stages) wait for their W; else the oldest pending W.
    # The first and last stage share device 0, so backward passes start early on
    # every device and memory evens out across them. Under unit costs the table
    # reaches the floor (p - 1) / (6m + p - 1): the last device's wait for its
    # first input, p - 1 chunk forwards, is the only idle time no table can fill.
    return _greedy_split(p, m, chunks=2, placement="v", memory=2 * p)


def _greedy_split(p: int, m: int, *, chunks: int, placement: str, memory: int) -> list[list[Action]]:
    stages = p * chunks
    f_tick: dict[tuple[int, int], int] = {}  # (mb, k) -> tick of its forward
    i_tick: dict[tuple[int, int], int] = {}  # (mb, k) -> tick of its backward-input
    # A stage's forwards (and input passes) become ready in micro-batch order, as
    # the previous (next) stage's run in that order: only the oldest is a candidate.
    next_f, next_i = [0] * stages, [0] * stages
    held = [0] * p  # chunk activations forwarded and not yet weight-gradient'ed
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, chunk)
    orders: list[list[Action]] = [[] for _ in range(p)]
    left = 3 * m * stages
    tick = 0
    while left:
        chosen: list[Action | None] = []
        for d in range(p):
            inputs, forwards = [], []
            for c in range(chunks):
                k = virtual_stage_of(d, c, p, placement)
                j = next_i[k]
                if (
                    j < m
                    and f_tick.get((j, k), tick) < tick
                    and (k == stages - 1 or i_tick.get((j, k + 1), tick) < tick)
                ):
                    inputs.append((j, -k, c))
                j = next_f[k]
                if j < m and (k == 0 or f_tick.get((j, k - 1), tick) < tick):
                    forwards.append((j, -k, c))
            if inputs:
                j, _, c = min(inputs)
                chosen.append((BACKWARD_INPUT, j, c))
            elif len(pending_w[d]) > stages - 2 and pending_w[d]:
                chosen.append((BACKWARD_WEIGHT, *pending_w[d][0]))
            elif forwards and held[d] < memory:
                j, _, c = min(forwards)
                chosen.append((FORWARD, j, c))
            elif pending_w[d]:
                chosen.append((BACKWARD_WEIGHT, *pending_w[d][0]))
            else:
                chosen.append(None)
        for d, act in enumerate(chosen):
            if act is None:
                continue
            kind, j, c = act
            k = virtual_stage_of(d, c, p, placement)
            if kind == FORWARD:
                f_tick[(j, k)] = tick
                next_f[k] += 1
                held[d] += 1
            elif kind == BACKWARD_INPUT:
                i_tick[(j, k)] = tick
                next_i[k] += 1
                pending_w[d].append((j, c))
            else:
                pending_w[d].pop(0)
                held[d] -= 1
            orders[d].append(act)
            left -= 1
        tick += 1
    return orders


def orders_dualpipe_v(p: int, m: int) -> list[list[Action]]:
    # DualPipeV (DeepSeek's DualPipe cut in half: deepseek-ai/DualPipe, dualpipev.py),
    # its eight steps per rank d, with chunk 0 = virtual stage d and chunk 1 =
    # stage 2p-1-d. Forwards and backwards of each chunk take micro-batches in
    # order; a zero-bubble backward (I) queues its W, which a later "weight"
    # step pops (FIFO). Where DualPipe overlaps a forward of one chunk with a
    # backward of the other (computation of one hiding the other's
    # communication), a table runs them in successive ticks.
    return [_dualpipe_v_order(p, m, d) for d in range(p)]


def _dualpipe_v_order(p: int, m: int, d: int) -> list[Action]:
    # Rank d's order (see orders_dualpipe_v).
    order: list[Action] = []
    next_f, next_b = [0, 0], [0, 0]
    queue: list[tuple[int, int]] = []

    def f(c: int) -> None:
        order.append((FORWARD, next_f[c], c))
        next_f[c] += 1

    def b(c: int, zero_bubble: bool = False) -> None:
        if zero_bubble:
            order.append((BACKWARD_INPUT, next_b[c], c))
            queue.append((next_b[c], c))
        else:
            order.append((BACKWARD, next_b[c], c))
        next_b[c] += 1

    def w() -> None:
        order.append((BACKWARD_WEIGHT, *queue.pop(0)))

    for _ in range(2 * (p - d - 1)):  # 1: forwards of chunk 0
        f(0)
    for _ in range(d + 1):  # 2: both chunks' forwards
        f(0)
        f(1)
    for _ in range(p - d - 1):  # 3: zero-bubble backward of chunk 1, its W, a forward
        b(1, True)
        w()
        f(1)
    for _ in range(m - 2 * p + d + 1):  # 4: the steady state, F0 B1 F1 B0
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - d - 1):  # 5: B1 F1 B0
        b(1)
        f(1)
        b(0)
    zero_bubble = False
    for i in range(d + 1):  # 6: both backwards; the second half zero-bubble
        if i == (d + 1) // 2 and d % 2 == 1:
            zero_bubble = True
        b(1, zero_bubble)
        if i == (d + 1) // 2 and d % 2 == 0:
            zero_bubble = True
        b(0, zero_bubble)
    for _ in range(p - d - 1):  # 7: a W, a zero-bubble backward of chunk 0
        w()
        b(0, True)
    while queue:  # 8: the remaining W's
        w()
    return order
