"""Shared pytest fixtures: seeded generators and a CUDA skip marker."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh seeded CPU generator (different tests use different draws through their own seeds)."""
    return torch.Generator().manual_seed(1234)
