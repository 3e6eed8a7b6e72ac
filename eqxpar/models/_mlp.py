"""A tensor-parallel MLP classifier built only from `eqxpar.nn` layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import nn
from .._errors import PlanError


class MLPClassifier(eqx.Module):
    """Classifies feature vectors with `depth` tensor-parallel MLP pairs.

    Pair `i` is an `eqxpar.nn.ColumnLinear` to `hidden` features (split over the
    tensor axis), GELU, and an `eqxpar.nn.RowLinear` back to whole features (one
    all-reduce per pair in manual mode): `in_features -> hidden` for the
    first pair's input, `hidden` between pairs (with a GELU), `num_classes` out of
    the last. The `eqxpar.nn` layers are batch-first `(batch, seq, features)`; the
    classifier adds and removes a unit sequence dimension around them.

    There is no sequence to split, so plans with `sequence_parallel=True` are
    rejected; every other plan (data parallel, FSDP, automatic or manual tensor
    parallel, partial-manual) runs the same instance.

    **Arguments:** `in_features`, `hidden` (a multiple of the tensor axis size),
    `num_classes`; keyword-only `depth=2` (number of column/row pairs),
    `use_bias=True`, `axis="tensor"`, `key`.

    Input `(batch, in_features)`; output logits `(batch, num_classes)`, whole.
    `MLPClassifier.loss(model, (x, labels))` is the mean cross-entropy.

    ```python
    model = eqxpar.models.MLPClassifier(784, 512, 10, key=jax.random.key(0))
    logits = model(x)                                   # x: (batch, 784)
    step = eqxpar.train.make_step(eqxpar.models.MLPClassifier.loss, optimizer, plan)
    ```
    """

    ups: list[nn.ColumnLinear]
    downs: list[nn.RowLinear]
    axis: str = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        hidden: int,
        num_classes: int,
        *,
        depth: int = 2,
        use_bias: bool = True,
        axis: str = "tensor",
        key: PRNGKeyArray,
    ):
        if not isinstance(depth, int) or depth < 1:
            raise PlanError(f"MLPClassifier(depth={depth!r}): expected a positive number of layer pairs.")
        keys = jax.random.split(key, 2 * depth)
        ins = [in_features] + [hidden] * (depth - 1)
        outs = [hidden] * (depth - 1) + [num_classes]
        self.ups = [
            nn.ColumnLinear(d_in, hidden, use_bias=use_bias, axis=axis, key=k)
            for d_in, k in zip(ins, keys[:depth], strict=True)
        ]
        self.downs = [
            nn.RowLinear(hidden, d_out, use_bias=use_bias, axis=axis, key=k)
            for d_out, k in zip(outs, keys[depth:], strict=True)
        ]
        self.axis = axis

    def __call__(self, x: Float[Array, "batch in_features"]) -> Float[Array, "batch num_classes"]:
        if nn.tensor_context(self.axis).sequence_parallel:
            raise PlanError(
                "MLPClassifier under a plan with sequence_parallel=True: a classifier's input has no "
                "sequence to split over the tensor axis. Use sequence_parallel=False."
            )
        h = x[:, None, :]  # a unit sequence for the batch-first layers
        for i, (up, down) in enumerate(zip(self.ups, self.downs, strict=True)):
            h = down(jax.nn.gelu(up(h)))
            if i + 1 < len(self.ups):
                h = jax.nn.gelu(h)
        return h[:, 0, :]

    @staticmethod
    def loss(
        model: "MLPClassifier", batch: tuple[Float[Array, "batch in_features"], Int[Array, " batch"]]
    ) -> Float[Array, ""]:
        """Mean softmax cross-entropy of `model` on `batch = (x, labels)`.

        The logits come out of a row-parallel layer whole (summed over the tensor
        axis), so this is the ordinary cross-entropy in every mode, in float32
        whatever the compute dtype (float64 logits stay float64).

        **Arguments:** `model`; `batch`: `x` `(batch, in_features)` and integer
        `labels` `(batch,)`.

        **Returns:** a float scalar (float32 at least), the mean over the batch (a valid `loss_fn` for
        `eqxpar.train.make_step`).

        ```python
        loss = eqxpar.models.MLPClassifier.loss(model, (x, labels))
        ```
        """
        x, labels = batch
        logits = model(x)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
