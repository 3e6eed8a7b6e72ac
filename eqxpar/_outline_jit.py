"""`OutlineJit`: `eqx.filter_jit` that also lowers from outlines.

Shared by the train builders (`make_value_and_grad`, `make_eval_step`) and
`eqxpar.models` (`lower_generate`). `eqx.filter_jit` traces only arrays and holds
every other leaf static, a `jax.ShapeDtypeStruct` included, so a model built under
`eqx.filter_eval_shape` reaches the function as outlines instead of tracers. Here
arrays and outlines are both traced, and one `jax.jit` serves both: a call with
arrays and a `.lower` with outlines of the same shapes and shardings give the same
program, which is what lets a step be compiled for a machine (a TPU topology, a
model too large for this host) from shapes alone.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._errors import PlanError
from ._specs import is_array_like


def has_outlines(tree: Any) -> bool:
    """Whether `tree` holds a `jax.ShapeDtypeStruct` leaf."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def refuse_outlines(tree: Any, what: str) -> None:
    """Raise `PlanError` when `tree` holds outlines: they compile but cannot run,
    and JAX's own error on a ShapeDtypeStruct argument does not say so."""
    if has_outlines(tree):
        raise PlanError(
            f"{what} was called with jax.ShapeDtypeStruct outlines (a state from train.init(..., "
            "abstract=True), a model built under eqx.filter_eval_shape): outlines have shapes but no "
            "values, so they compile but cannot run. Use .lower(...) / .compile(...) with them, or pass "
            "arrays."
        )


class OutlineJit:
    """`fn` compiled once per static part of its arguments; arrays and outlines
    are its traced inputs, every other leaf (functions, configs, layouts) static.

    `__call__(*args, **kwargs)` runs it on arrays (outlines are refused, naming
    `lower`); `.lower(*args, **kwargs)` lowers it for arrays or outlines and
    gives a `jax.stages.Lowered` (`.compile()` for memory, cost and HLO).
    Non-array outputs come back as the trace left them, as with `eqx.filter_jit`.
    """

    def __init__(self, fn: Callable, *, what: str):
        self._fn = fn
        self._what = what
        self._cache: dict[Any, tuple[Any, list]] = {}

    def _jitted(self, args: Any) -> tuple[Any, list, Any]:
        dynamic, static = eqx.partition(args, is_array_like)
        static_leaves, static_def = jax.tree.flatten(static)
        cache_key: Any = (static_def, tuple(static_leaves), jax.tree.structure(dynamic))
        try:
            hash(cache_key)
        except TypeError:  # an unhashable static leaf: traced afresh each call
            cache_key = object()
        cached = self._cache.get(cache_key)
        if cached is None:
            # The output's non-array part, recorded when the function is traced.
            out_static: list = []

            @functools.wraps(self._fn)
            def run(dynamic: Any) -> Any:
                positional, keywords = eqx.combine(dynamic, static)
                out_dynamic, rest = eqx.partition(self._fn(*positional, **keywords), is_array_like)
                out_static[:] = [rest]
                return out_dynamic

            cached = self._cache[cache_key] = (jax.jit(run), out_static)
        jitted, out_static = cached
        return jitted, out_static, dynamic

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        refuse_outlines((args, kwargs), self._what)
        jitted, out_static, dynamic = self._jitted((args, kwargs))
        out_dynamic = jitted(dynamic)
        return eqx.combine(out_dynamic, out_static[0])

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lower for `args` (arrays or `jax.ShapeDtypeStruct` outlines); nothing runs."""
        jitted, _, dynamic = self._jitted((args, kwargs))
        return jitted.lower(dynamic)
