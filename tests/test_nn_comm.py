"""What the tensor-parallel layers put on the wire, read from the compiled HLO.

The regions here are manual over both `data` and `tensor`. (In a partial-manual
region, with `data` left automatic, XLA 0.10 partitions an all-gather or
reduce-scatter over `tensor` by first gathering the automatic batch dimension over
`data`; all-reduce and collective-permute keep it. See test_partial_manual_*.)"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn

D, HIDDEN, VOCAB, BATCH, SEQ, TP = 32, 64, 256, 8, 16, 4


def plan(**options):
    return eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=TP), rules=eqxpar.rules.MEGATRON, mode="manual", **options
    )


def batch(spec: P) -> P:
    """`spec` with the batch dimension split over `data` (a manual axis here)."""
    return P("data", *spec[1:]) if len(spec) else P("data")


def compiled_mlp_forward(plan):
    mlp = nn.MLP(D, HIDDEN, key=jax.random.key(0))
    seq = P(None, "tensor") if plan.sequence_parallel else P()
    f = eqxpar.filter_shard_map(
        lambda m, x: m(x),
        plan,
        in_specs=(None, batch(seq)),
        out_specs=batch(seq),
        axis_names={"data", "tensor"},
    )
    x = eqxpar.shard_batch(jnp.ones((BATCH, SEQ, D)), plan)
    with plan:
        return jax.jit(f).lower(eqxpar.shard(mlp, plan), x).compile()


def test_sync_mlp_without_sequence_parallel_is_one_all_reduce():
    stats = eqxpar.inspect.collective_stats(compiled_mlp_forward(plan()))
    assert dict(stats.count) == {"all-reduce": 1}
    # The output activations of this device's half of the batch.
    assert stats.bytes["all-reduce"] == (BATCH // 2) * SEQ * D * 4


def test_sync_mlp_with_sequence_parallel_is_one_gather_and_one_scatter():
    stats = eqxpar.inspect.collective_stats(compiled_mlp_forward(plan(sequence_parallel=True)))
    assert dict(stats.count) == {"all-gather": 1, "reduce-scatter": 1}
    full = (BATCH // 2) * SEQ * D * 4
    assert stats.bytes["all-gather"] == full
    assert stats.bytes["reduce-scatter"] == full // TP


def test_overlapped_mlp_moves_the_same_bytes_by_collective_permute_only():
    sync = eqxpar.inspect.collective_stats(compiled_mlp_forward(plan(sequence_parallel=True)))
    ring = eqxpar.inspect.collective_stats(
        compiled_mlp_forward(plan(sequence_parallel=True, tp_overlap=True))
    )
    assert set(ring.count) == {"collective-permute"}
    # Wire bytes of the replaced collectives on a ring: an all-gather moves (n-1)/n of
    # its result, a reduce-scatter (n-1) times its result.
    replaced = sync.bytes["all-gather"] * (TP - 1) // TP + sync.bytes["reduce-scatter"] * (TP - 1)
    assert ring.bytes["collective-permute"] == replaced


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_cross_entropy_moves_per_token_scalars(sequence_parallel):
    p = plan(sequence_parallel=sequence_parallel)
    logits = jax.random.normal(jax.random.key(0), (BATCH, SEQ, VOCAB))
    labels = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    f = eqxpar.filter_shard_map(
        lambda z, y: nn.cross_entropy(z, y, vocab_split=True),
        p,
        in_specs=(P("data", None, "tensor"), P("data")),
        out_specs=P("data"),
        axis_names={"data", "tensor"},
    )
    logits, labels = eqxpar.shard_batch((logits, labels), p)
    with p:
        stats = eqxpar.inspect.collective_stats(jax.jit(f).lower(logits, labels).compile())
    per_token = (BATCH // 2) * SEQ * 4
    # The max, the sum of exponentials and the target logit: one float per token each.
    assert stats.total_bytes <= 3 * per_token
    assert set(stats.count) <= {"all-reduce"}
    assert stats.total_bytes < (BATCH // 2) * SEQ * (VOCAB // TP) * 4 / 10
