"""The planner: pure functions from a layer graph to a frozen Plan. No device is touched."""

from .costs import H200, LayerCosts, Machine, layer_costs
from .plan import AUTO_ORDER, LayerInfo, Plan, Step, plan, plan_graph
from .policy import Action, Policy, Segment, Strategy, parse_policy, parse_strategy
from .route import route

__all__ = ["plan", "plan_graph", "Plan", "LayerInfo", "Step", "Policy", "Strategy", "Action",
           "Segment", "route", "layer_costs", "LayerCosts", "Machine", "H200", "parse_policy", "parse_strategy",
           "AUTO_ORDER"]
