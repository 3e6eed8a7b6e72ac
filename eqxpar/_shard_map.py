"""`filter_shard_map`: `jax.shard_map` over Equinox modules with non-array leaves."""

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec

from ._errors import AxisNameError, PlanError
from ._plan import Plan
from ._specs import check_spec, drop_axes, is_array_like, partition_specs


def _check_specs(tree: Any, specs: Any, mesh: Mesh, *, where: str) -> None:
    leaves, treedef = jax.tree.flatten(tree)
    try:
        spec_leaves = (
            treedef.flatten_up_to(specs) if not isinstance(specs, PartitionSpec) else [specs] * len(leaves)
        )
    except (ValueError, TypeError) as e:
        raise PlanError(
            f"{where}: the specs {specs!r} do not match the structure of the argument "
            f"({treedef}). Give one PartitionSpec for the whole argument, a pytree "
            "of specs mirroring it (eqxpar.partition_specs), or None for the plan's rules."
        ) from e
    for leaf, spec in zip(leaves, spec_leaves, strict=True):
        if spec is not None and is_array_like(leaf):
            check_spec(spec, tuple(leaf.shape), mesh, where=f"{where}, array of shape {tuple(leaf.shape)}")


def region_manual_axes(mesh: Mesh, axis_names: Collection[str]) -> frozenset[str]:
    """The axes a `shard_map` over `axis_names` is really manual over: all of them
    in a fully manual region; in a partial-manual one, those of size > 1 (a size-1
    axis splits nothing, and XLA rejects collectives over a size-1 manual axis there)."""
    manual = frozenset(axis_names)
    if manual == frozenset(mesh.axis_names):
        return manual
    return frozenset(a for a in manual if mesh.shape[a] > 1)


def filter_shard_map(
    fn: Callable,
    plan: Plan,
    *,
    in_specs: Sequence[Any] | None = None,
    out_specs: Any,
    axis_names: Collection[str] | None = None,
    check_vma: bool = True,
) -> Callable:
    """`jax.shard_map` that takes and returns Equinox modules.

    Non-array leaves (activation functions, static settings, Python scalars) pass
    through untouched; only arrays are split over the mesh. Input specs default to
    the plan's rules, so a model goes in with one line.

    **Arguments:**

    - `fn`: the per-device function. Inside it the manual axes' collectives
      (`jax.lax.psum(x, "data")`, ...) are available.
    - `plan`: gives the mesh, and the rules for inputs without a spec.
    - `in_specs`: one entry per positional argument: None (use the plan's rules, so
      replicated weights come in replicated and sharded weights as shards), a
      `PartitionSpec` for every array leaf of that argument (e.g.
      `plan.batch_spec`), or a pytree of specs mirroring it. Default: all from rules.
    - `out_specs`: a `PartitionSpec` for every output array, or a pytree of them
      mirroring the output (non-array positions may hold None, as
      `eqxpar.partition_specs` returns).
    - `axis_names`: the manual mesh axes; default all of them. Others stay automatic.
      In a partial-manual region, axes of size 1 are left automatic (they split
      nothing, and XLA rejects collectives over a size-1 manual axis there); if no
      manual axis is left, `fn` runs directly. Code that must work at size 1 should
      not name such an axis in its own collectives (eqxpar.nn layers don't).
    - `check_vma`: as in `jax.shard_map`. With it on, the gradient of a replicated
      input w.r.t. a per-device loss comes back already summed over the devices
      the loss varies along: do not `psum`/`pmean` it again.

    **Returns:** a function of the same arguments that returns `fn`'s output, with
    arrays reassembled into global arrays.

    ```python
    def local_loss(model, x, y):
        return jax.lax.pmean(jnp.mean((jax.vmap(model)(x) - y) ** 2), ("data", "fsdp"))

    loss = eqxpar.filter_shard_map(local_loss, plan,
                                   in_specs=(None, plan.batch_spec, plan.batch_spec),
                                   out_specs=P())(model, x, y)
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"filter_shard_map(..., plan={plan!r}): expected an eqxpar.Plan.")
    manual = _manual_axes(plan.mesh, axis_names)

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        if in_specs is not None and len(in_specs) != len(args):
            raise PlanError(
                f"filter_shard_map: in_specs has {len(in_specs)} entries but the function "
                f"was called with {len(args)} positional arguments; give one entry per "
                "argument (None to use the plan's rules)."
            )
        _check_not_nested()
        dynamic, static = eqx.partition(args, eqx.is_array)
        specs = _input_specs(dynamic, in_specs, plan.rules, plan.mesh, manual)
        if not manual:
            return fn(*args)
        return _run_region(fn, plan.mesh, dynamic, static, specs, out_specs, manual, check_vma)

    return wrapped


def _manual_axes(mesh: Mesh, axis_names: Collection[str] | None) -> frozenset[str]:
    manual = frozenset(mesh.axis_names if axis_names is None else axis_names)
    for axis in manual:
        if axis not in mesh.axis_names:
            raise AxisNameError(
                f"filter_shard_map(axis_names=...) names mesh axis {axis!r}, but the mesh "
                f"has axes {tuple(mesh.axis_names)}. Use one of those names."
            )
    return region_manual_axes(mesh, manual)


def _keep_manual(specs: Any, mesh: Mesh, manual: frozenset[str]) -> Any:
    # Spec entries naming an axis left automatic would not be manual specs.
    dropped = frozenset(mesh.axis_names) - manual
    return jax.tree.map(
        lambda s: drop_axes(s, dropped) if isinstance(s, PartitionSpec) else s,
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def _check_not_nested() -> None:
    inside = sorted(jax.sharding.get_abstract_mesh().manual_axes)
    if inside:
        raise PlanError(
            f"filter_shard_map called inside a region already manual over {inside} (e.g. the loss "
            "of an eqxpar step with mode='manual', a pipeline, or another filter_shard_map): there "
            "the function already runs per device, on the batch's shards. Call it directly, with "
            "collectives over the step's axes (e.g. jax.lax.pmean(x, plan.batch_axes)), or build "
            "the step with mode='auto' to keep your own filter_shard_map."
        )


def _input_specs(
    dynamic: tuple, in_specs: Sequence[Any] | None, rules: Any, mesh: Mesh, manual: frozenset[str]
) -> list:
    # `rules`: the plan's, for the inputs given no spec.
    specs = []
    for i, arg in enumerate(dynamic):
        given = None if in_specs is None else in_specs[i]
        spec = partition_specs(arg, rules, mesh=mesh) if given is None else given
        _check_specs(arg, spec, mesh, where=f"filter_shard_map argument {i}")
        specs.append(_keep_manual(spec, mesh, manual))
    return specs


def _run_region(
    fn: Callable,
    mesh: Mesh,
    dynamic: tuple,
    static: tuple,
    specs: list,
    out_specs: Any,
    manual: frozenset[str],
    check_vma: bool,
) -> Any:
    out_static: list[Any] = []

    def per_device(dynamic):
        out = fn(*eqx.combine(dynamic, static))
        out_dynamic, static_part = eqx.partition(out, eqx.is_array)
        out_static.append(static_part)
        return out_dynamic

    out_dynamic = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(tuple(specs),),
        out_specs=_keep_manual(out_specs, mesh, manual),
        axis_names=set(manual),
        check_vma=check_vma,
    )(tuple(dynamic))
    return eqx.combine(out_dynamic, out_static[-1])
