"""pytest set-up: the mha package comes from the build tree (PYTHONPATH=<build>/python, set by ctest)."""
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
