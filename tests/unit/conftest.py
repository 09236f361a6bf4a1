"""Shared fixtures of the CPU unit tests."""

from __future__ import annotations

import random

import pytest


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed per test, printed so that a failure can be replayed."""
    s = random.randrange(1 << 30)
    print(f"{request.node.name}: seed={s}")
    return s
