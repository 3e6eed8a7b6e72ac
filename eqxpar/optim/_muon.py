"""`eqxpar.optim.muon`: optax's Muon whose Newton–Schulz runs on whole matrices,
each on one owner device, under any plan."""

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, PyTree

from .._errors import EqxparError
from .._update_layout import current_update_layout
from ._exchange import orthogonalize_on_mesh
from ._optax_muon import optax_muon

_DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
_is_dims = lambda x: isinstance(x, optax.contrib.MuonDimensionNumbers)  # noqa: E731


def _orthogonalized(mu_hat: PyTree, dims: PyTree, coeffs: Array, orthogonalize: Callable) -> PyTree:
    """`mu_hat` with every matrix orthogonalised: where the running step published
    its layout (`eqxpar._update_layout`), on the mesh with owners; elsewhere (an
    update called by hand, one device) as optax does, leaf by leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
    dim_leaves = treedef.flatten_up_to(dims) if dims is not None else [None] * len(flat)
    layout = current_update_layout()
    out = [None] * len(flat)
    on_mesh = []
    for i, (path, x) in enumerate(flat):
        spec = None if layout is None or layout.mesh.size == 1 else layout.spec(path)
        if spec is None:
            out[i] = orthogonalize(x, coeffs, dim_leaves[i])
        else:
            on_mesh.append((i, spec))
    if on_mesh:
        mesh: Mesh = layout.mesh  # type: ignore[union-attr]
        done = orthogonalize_on_mesh(
            [flat[i][1] for i, _ in on_mesh],
            [dim_leaves[i] for i, _ in on_mesh],
            [s for _, s in on_mesh],
            mesh,
            orthogonalize,
            coeffs,
        )
        for (i, _), y in zip(on_mesh, done, strict=True):
            out[i] = y
    return jax.tree.unflatten(treedef, out)


def scale_by_muon(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Literal["frobenius", "spectral", "aol", "schatten"] = "frobenius",
    weight_dimension_numbers: Any = None,
) -> optax.GradientTransformation:
    """`optax.contrib.scale_by_muon` (the same arguments, state and numbers) whose
    orthogonalisation moves whole matrices to one owner device each, instead of
    leaving the compiler to gather every matrix on every device.

    Under an eqxpar step (`eqxpar.train.make_step`) each matrix whose spec splits it
    (FSDP, ZeRO-1, tensor parallelism) is sent whole to one owner among the devices
    that hold its blocks (balanced by size), orthogonalised there, and only its
    blocks come back: about twice the Muon leaves' bytes per step over all devices.
    Matrices that no spec splits (data parallelism, a stack split over `pipe`,
    experts over `expert`) are orthogonalised where they lie. Called outside a step
    it is optax's, leaf by leaf.

    **Arguments:** those of `optax.contrib.scale_by_muon` (optax >= 0.2.8).

    **Returns:** an `optax.GradientTransformation` whose state is
    `optax.contrib.MuonState`.

    ```python
    tx = optax.chain(eqxpar.optim.scale_by_muon(), optax.scale(-0.02))
    ```
    """
    module = optax_muon()
    reference = module.scale_by_muon(
        ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
        preconditioning=preconditioning, weight_dimension_numbers=weight_dimension_numbers,
    )  # fmt: skip
    mu_dtype = jax.dtypes.canonicalize_dtype(mu_dtype) if mu_dtype is not None else None

    def orthogonalize(x: Array, coeffs: Array, dims: Any) -> Array:
        return module.orthogonalize_via_newton_schulz(x, coeffs, ns_steps, preconditioning, eps, dims)

    def update_fn(updates: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]:
        del params
        dims = (
            weight_dimension_numbers(updates)
            if callable(weight_dimension_numbers)
            else weight_dimension_numbers
        )
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count_inc = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
                optax.tree.bias_correction(updates, beta, count_inc),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count_inc)
        new = _orthogonalized(mu_hat, dims, state.ns_coeffs, orthogonalize)
        if adaptive:
            new = jax.tree.map(lambda x, y: jnp.sum(x.conj() * y) * y, mu_hat, new)
        mu = optax.tree.cast(mu, mu_dtype)
        return new, optax.contrib.MuonState(count=count_inc, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(reference.init, update_fn)


def _labels_and_dims(dimension_numbers: Any) -> tuple[Callable, Callable]:
    """optax.contrib.muon's two functions of the parameters: each leaf's label
    (`"muon"` or `"adam"`), and the Muon leaves' dimension numbers with optax's
    `MaskedNode` where the Adam leaves are masked out."""
    masked = optax.transforms.MaskedNode
    if dimension_numbers is None:

        def labels(params: PyTree) -> PyTree:
            return jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)

        dimension_numbers = optax.contrib.MuonDimensionNumbers()
    else:

        def labels(params: PyTree) -> PyTree:
            dims = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
            fill = lambda d, x: jax.tree.map(lambda _: "muon" if d is not None else "adam", x)  # noqa: E731
            return jax.tree.map(fill, dims, params, is_leaf=lambda x: x is None or _is_dims(x))

    def dims_of(params: PyTree) -> PyTree:
        dims = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
        mask = jax.tree.map(lambda label: label == "muon", labels(params))
        is_leaf = lambda x: x is None or _is_dims(x) or isinstance(x, masked)  # noqa: E731
        fill = lambda d, sub: jax.tree.map(lambda m: d if m else masked(), sub)  # noqa: E731
        return jax.tree.map(fill, dims, mask, is_leaf=is_leaf)

    return labels, dims_of


def muon(
    learning_rate: Any,
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Literal["frobenius", "spectral", "aol", "schatten"] = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: Any = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
) -> optax.GradientTransformation:
    """Muon (momentum orthogonalised by Newton–Schulz) for any plan:
    `optax.contrib.muon`'s arguments, state and numbers, with each matrix
    orthogonalised whole on one owner device.

    Newton–Schulz needs a whole matrix. Under FSDP, ZeRO-1 or tensor parallelism a
    device holds a block of each; left to the compiler, optax's Muon gathers every
    matrix on every device, several times. Here the step's layout says where each
    block lies: each matrix goes whole to one owner (balanced by size over the
    devices that hold its blocks, one all-to-all), is orthogonalised there, and only
    its blocks come back (another), so the update moves about twice the Muon
    parameters' bytes over all devices. The momentum, the shape scaling, the weight
    decay and the AdamW fallback are elementwise and stay where the parameters are.

    Which leaves Muon treats is optax's rule: every 2-D leaf by default, or those
    `muon_weight_dimension_numbers` gives a `optax.contrib.MuonDimensionNumbers`
    (a tree mirroring the parameters, or a function of them; None puts a leaf on
    AdamW). A leaf with more dimensions is a batch of matrices (the reduction and
    output dimensions make each; the others, e.g. an `eqxpar.nn.Stacked` layer
    axis, index them), each orthogonalised on its own, as optax does: give a
    stacked weight `MuonDimensionNumbers(1, 2)` (its default 2-D rule puts every
    3-D leaf on AdamW). See the fine-tuning guide for the usual recipe
    (embeddings, norms and the head on AdamW).

    **Arguments:** those of `optax.contrib.muon` (optax >= 0.2.8; an older optax
    raises `eqxpar.EqxparError` naming the upgrade): `learning_rate` (a float or a
    schedule), `ns_coeffs` (a triple, a tuple of triples or a preset name),
    `ns_steps`, `beta`, `eps`, `weight_decay`, `weight_decay_mask`, `mu_dtype`;
    keyword-only `nesterov`, `adaptive`, `preconditioning`, `adam_b1`, `adam_b2`,
    `adam_eps_root`, `adam_weight_decay`, `adam_learning_rate`,
    `muon_weight_dimension_numbers`, `consistent_rms`.

    **Returns:** an `optax.GradientTransformation` with `optax.contrib.muon`'s
    state, for `eqxpar.train.init` and `eqxpar.train.make_step` under any plan.
    Outside an eqxpar step (an update called by hand) it computes as optax does.

    ```python
    optim = eqxpar.optim.muon(0.02, muon_weight_dimension_numbers=dims)
    state = eqxpar.train.init(model, optim, plan, key=key)
    step = eqxpar.train.make_step(loss_fn, optim, plan)
    ```
    """
    module = optax_muon()
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    if isinstance(ns_coeffs, str):
        presets = module._NS_COEFFS_PRESET_DICT
        if ns_coeffs not in presets:
            raise EqxparError(
                f"muon(ns_coeffs={ns_coeffs!r}): unknown preset; expected one of {sorted(presets)} or a "
                "triple of coefficients."
            )
        ns_coeffs = presets[ns_coeffs]
    labels, dims_of = _labels_and_dims(muon_weight_dimension_numbers)
    return optax.partition(
        transforms={
            "muon": optax.chain(
                scale_by_muon(
                    ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
                    preconditioning=preconditioning, weight_dimension_numbers=dims_of,
                ),
                module.scale_by_shape(weight_dimension_numbers=dims_of, consistent_rms=consistent_rms),
                optax.add_decayed_weights(weight_decay, weight_decay_mask),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(
                learning_rate=adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps, eps_root=adam_eps_root,
                weight_decay=adam_weight_decay, mu_dtype=mu_dtype, nesterov=nesterov,
            ),
        },
        param_labels=labels,
    )  # fmt: skip
