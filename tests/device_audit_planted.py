"""Planted for tests/test_device_option.py's audit (not a test file, never collected by default):
one tensor made at import off `--device`, one parametrize value off it, one moved as it should be."""

import pytest
import torch
from devices import DEVICE

STRAY = torch.zeros(1)  # device-audit: planted
MOVED = torch.zeros(1).to(DEVICE)


@pytest.mark.parametrize("x", [torch.ones(1)])  # device-audit: planted
def test_planted(x):
    assert x.shape == (1,)
