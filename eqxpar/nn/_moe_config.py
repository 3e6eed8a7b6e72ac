"""The routing options of an `MoE` layer, checked once when they are given."""

import dataclasses

from .._config_check import check_bool, check_choice, check_positive_int, field_error, is_int
from .._errors import PlanError

SCORES = ("softmax", "sigmoid")
EXCHANGES = ("auto", "ragged", "padded")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How an `eqxpar.nn.MoE` layer routes, besides its widths; frozen and
    hashable. Every field is checked when the config is built, so a bad one names
    itself (an eqxpar error) instead of failing inside the layer.

    **Fields:**

    - `experts`: number of routed experts (a positive integer).
    - `top_k`: experts per token, `1 <= top_k <= experts` (default 2).
    - `score`: `"softmax"` (default) or `"sigmoid"` router scores.
    - `normalize_top_k`: the chosen experts' weights sum to 1 (default True).
    - `route_scale`: a factor on the combine weights (default 1.0).
    - `capacity_factor`: None (default: dropless) or a number > 0: each expert
      takes at most `ceil(capacity_factor * tokens * top_k / experts)` assignments.
    - `num_shared`: shared experts applied to every token (default 0).
    - `shared_hidden`: each shared expert's hidden features (default None: the
      layer's `hidden`).
    - `exchange`: how a dropless layer under expert parallelism sends tokens to
      their experts' devices and back: `"ragged"` (`jax.lax.ragged_all_to_all`:
      only the routed rows cross; XLA:CPU cannot compile it, so a CPU plan
      refuses it with a `PlanError`), `"padded"` (dense
      all-to-alls of buffers with room for the worst case: `devices` times the
      routed rows; every backend), or `"auto"` (default: ragged where the plan
      being traced is on TPU, padded elsewhere). Both give the same numbers.

    ```python
    config = eqxpar.nn.MoEConfig(8, top_k=2, num_shared=1)
    moe = eqxpar.nn.MoE(256, 512, config, key=key)
    ```
    """

    experts: int
    top_k: int = 2
    score: str = "softmax"
    normalize_top_k: bool = True
    # int | float: a scale or capacity of 2 is as good as 2.0 (checked below).
    route_scale: int | float = 1.0
    capacity_factor: int | float | None = None
    num_shared: int = 0
    shared_hidden: int | None = None
    exchange: str = "auto"

    def __post_init__(self):
        owner = "MoEConfig"
        check_positive_int(owner, "experts", self.experts)
        top_k, experts = self.top_k, self.experts
        if not (is_int(top_k) and 1 <= top_k <= experts):
            raise field_error(
                PlanError,
                owner,
                f"expected an integer from 1 to experts={experts} (the experts each token is sent to), "
                f"e.g. top_k={min(2, experts)}.",
                top_k=top_k,
            )
        check_choice(owner, "score", self.score, SCORES)
        check_bool(owner, "normalize_top_k", self.normalize_top_k)
        scale = self.route_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise field_error(
                PlanError, owner, "expected a number (1.0: the combine weights as routed).", route_scale=scale
            )
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or not cf > 0):
            raise field_error(
                PlanError,
                owner,
                "expected a number > 0 (e.g. 1.25: each expert takes at most "
                "ceil(1.25 * tokens * top_k / experts) assignments), or None for dropless routing.",
                capacity_factor=cf,
            )
        if not (is_int(self.num_shared) and self.num_shared >= 0):
            raise field_error(
                PlanError,
                owner,
                "expected an integer >= 0 (0: no shared experts).",
                num_shared=self.num_shared,
            )
        check_positive_int(owner, "shared_hidden", self.shared_hidden, optional=True)
        check_choice(owner, "exchange", self.exchange, EXCHANGES)
