"""Mixture-of-experts layers of the sparse all-MLP (sMLP, Yu et al. 2022).

``routers``: pure routing functions (Switch, GShard top-k, Base Layers'
balanced assignment, Hash). ``tmoe``: token-routed feed-forward experts.
``smoe``: hidden-dimension-routed spatial (token-mixing) experts.
"""
from hypermixer_jax.models.moe.routers import (balanced_assignment, base_route,
                                               expert_capacity, hash_route,
                                               load_balancing_loss,
                                               make_hash_table, router_z_loss,
                                               switch_route, top_k_route)
from hypermixer_jax.models.moe.smoe import (SparseGatingUnit,
                                            SparseSpatialMixing,
                                            partial_loss_weights,
                                            partial_prefix_len)
from hypermixer_jax.models.moe.tmoe import (MoeFeedForward, apply_experts,
                                            expert_mesh_size)

__all__ = [
    "balanced_assignment", "base_route", "expert_capacity", "hash_route",
    "load_balancing_loss", "make_hash_table", "router_z_loss", "switch_route",
    "top_k_route", "SparseGatingUnit", "SparseSpatialMixing",
    "partial_loss_weights", "partial_prefix_len", "MoeFeedForward", "apply_experts",
    "expert_mesh_size",
]
