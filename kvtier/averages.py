"""The moving average kvtier's measured rates and step times keep."""
from __future__ import annotations


def moving_average(old: float | None, new: float, weight: float) -> float:
    """new, weighted `weight` against the average so far (old: None before the first measurement)."""
    return new if old is None else (1 - weight) * old + weight * new
