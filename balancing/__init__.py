"""Cost-balanced assignment of samples to (step, rank). NumPy + OR-Tools; never imports Spark."""
from balancing.metrics import bubble
from balancing.partition import partition
from balancing.strategies import STRATEGIES
from balancing.types import InfeasibleError, Partition, Plan
from balancing.window import plan

__all__ = ["STRATEGIES", "InfeasibleError", "Partition", "Plan", "bubble", "partition", "plan"]
