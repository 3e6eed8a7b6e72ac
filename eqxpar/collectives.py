"""Pure collectives for use inside `jax.shard_map`: gathers, reduce-scatters and
all-to-alls with the right gradients, and ring (`ppermute`) collective matmuls."""

from ._collectives import all_gather as all_gather
from ._collectives import all_gather_matmul as all_gather_matmul
from ._collectives import all_gather_mean_grad as all_gather_mean_grad
from ._collectives import all_to_all as all_to_all
from ._collectives import matmul_reduce_scatter as matmul_reduce_scatter
from ._collectives import psum_scatter as psum_scatter
