"""Optimizers that know the plan: `muon`, optax's Muon with each matrix
orthogonalised whole on one owner device (`scale_by_muon`, its orthogonalising
transformation), for `eqxpar.train.make_step` under any plan."""

from ._muon import muon as muon
from ._muon import scale_by_muon as scale_by_muon
