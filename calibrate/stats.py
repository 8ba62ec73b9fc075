"""Robust per-size statistics of timing samples: ``calibrate.measure.stats`` (the one home of the
project's statistics), under the name the calibration harness imports."""
from __future__ import annotations

from calibrate.measure.stats import median_ci, summarize

__all__ = ["median_ci", "summarize"]
