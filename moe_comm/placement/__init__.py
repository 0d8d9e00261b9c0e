"""Rebalancing: the placement planner (EPLB-style) and applying a plan (weights, optimizer state, replicas)."""
from moe_comm.placement.planner import Placement, identity_placement, plan_placement, rank_loads

__all__ = ["Placement", "plan_placement", "identity_placement", "rank_loads"]
