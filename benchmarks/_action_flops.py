"""Matmul FLOPs of one pipeline action on one device, compiled apart from any pipeline."""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxpar
from eqxpar.models import gpt_first, gpt_last
from eqxpar.pipeline._split_backward import split_pull_back

from . import _workload


def engine_actions(stage: Any, params: Any, x: jax.Array, seed: jax.Array) -> dict[str, tuple]:
    """The engine's actions `F`, `B`, `I`, `W` of `stage(params, x)`, each `(function, arguments)`."""
    _, pull = jax.jit(lambda p, x: jax.vjp(stage, p, x))(params, x)
    halves, inputs = split_pull_back(*jax.tree.flatten(pull), seed, first=False)
    stash = jax.jit(lambda *a: halves.input_half(a))(*inputs)[1]
    return {
        "F": (lambda p, x: jax.vjp(stage, p, x), (params, x)),
        "B": (lambda pull, seed: pull(seed), (pull, seed)),
        "I": (lambda *a: halves.input_half(a), tuple(inputs)),
        "W": (lambda stash, *a: halves.weight_half(a, stash), (stash, *inputs)),
    }


def _per_action(stage: Any, params: Any, x: jax.Array, seed: jax.Array) -> dict[str, int]:
    """Matmul FLOPs of each of `engine_actions`, compiled."""
    return {
        name: eqxpar.inspect.matmul_flops(jax.jit(fn).lower(*args).compile())
        for name, (fn, args) in engine_actions(stage, params, x, seed).items()
    }


# Cached: the pipeline records of one mesh share their stage; each call compiles eight functions.
@functools.cache
def action_flops(cfg: _workload.Config, *, layers: int, rows: int, tensor: int = 1) -> dict:
    """`{"stage": {F, B, I, W}, "head": {...}}`: matmul FLOPs of a virtual stage on one micro-batch."""
    model = _workload.make_model(dataclasses.replace(cfg, layers=layers))
    tokens = _workload.make_batches(1, dataclasses.replace(cfg, batch=rows))[0]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = gpt_first(model, tokens)

    def middle(params: Any, x: jax.Array) -> jax.Array:
        return eqx.combine(params, static).blocks(x)

    def last(params: Any, x: jax.Array) -> jax.Array:
        whole = eqx.combine(params, static)
        return gpt_last(whole, whole.blocks(x), tokens)

    stage = _per_action(middle, params, x, jnp.ones_like(x))
    with_head = _per_action(last, params, x, jnp.ones((), jnp.float32))
    return {
        "stage": {k: f / tensor for k, f in stage.items()},
        "head": {k: (with_head[k] - stage[k]) / tensor for k in stage},
    }


def pipeline_table_flops(schedule: Any, flops: dict, layers=None) -> eqxpar.pipeline.Simulation:
    """`schedule` priced at `action_flops`'s FLOPs: its `lockstep_s` is what a device runs in lockstep
    (`layers`: `flops` are one layer's, times each stage's count)."""
    return eqxpar.pipeline.simulate(schedule, flops["stage"], last_stage=flops["head"], stage_layers=layers)
