"""What eqxpar reads of JAX's internals, written once for every supported JAX release.

Shared by the subpackages that walk jaxprs (`eqxpar.inspect`'s minimum-traffic count,
`eqxpar.pipeline`'s split backward): where JAX 0.10 and 0.11+ describe the same thing
differently, both read it through here, so a new release is handled in one place.
"""

from typing import Any

import jax
from jax.extend import core


def scan_body(eqn: Any) -> tuple[core.Jaxpr, list, int, int]:
    """A scan equation's `(body, body constants, number of constant inputs, number of
    carries)`.

    The body's inputs line up one to one with the equation's: the constants, then the
    carries, then the scanned-over values; its outputs are the carries, then the
    stacked values. `body constants` are the values of the body's own `constvars`
    (a closed body's, on JAX 0.10; none on 0.11 and later, whose body is open).
    """
    params = eqn.params
    if "num_consts" in params:  # JAX 0.10: a closed body and two counts
        body = params["jaxpr"]
        return body.jaxpr, list(body.consts), params["num_consts"], params["num_carry"]
    # JAX 0.11 and later: the inputs as a tree of three (constants, carries,
    # scanned-over values) whose leaves are the inputs in order.
    consts, carry, xs = params["ft_in"].unpack()
    counts = [len(part.vals) for part in (consts, carry, xs)]
    body = params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    if sum(counts) != len(eqn.invars) or len(body.invars) != len(eqn.invars) or body.constvars:
        raise NotImplementedError(
            f"this JAX's scan ({jax.__version__}) describes its inputs in a way eqxpar does not "
            f"know: {counts} for {len(eqn.invars)} inputs. eqxpar supports JAX 0.10.2 to 0.12.x; "
            "install a release in that range."
        )
    return body, [], counts[0], counts[1]
