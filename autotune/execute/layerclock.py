"""Marks on the device's timeline for a step's timer: on GPUs a CUDA event recorded on the current stream when
the host issues it (the time between two marks is the device's time for the work issued between them, plus any
wait for the host); on CPUs the host's clock. Nothing here synchronises."""
from __future__ import annotations

from calibrate.optional import require_torch

torch = require_torch()
from calibrate.measure.torcharm import mark as device_mark, span


def mark(gpu: bool):
    """A point on the device's timeline (``calibrate.measure.torcharm.mark``: a CUDA event on GPUs,
    the host's clock on CPUs)."""
    return device_mark(torch, gpu)


__all__ = ["mark", "span"]
