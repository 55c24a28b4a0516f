"""Cost-balanced assignment of samples to (step, rank). NumPy + OR-Tools; never imports Spark."""
from freescale.balancing.metrics import bubble
from freescale.balancing.partition import partition
from freescale.balancing.plan_options import PlanOptions
from freescale.balancing.strategies import STRATEGIES
from freescale.balancing.types import InfeasibleError, Partition, Plan
from freescale.balancing.window import plan

__all__ = ["STRATEGIES", "InfeasibleError", "Partition", "Plan", "PlanOptions", "bubble", "partition", "plan"]
