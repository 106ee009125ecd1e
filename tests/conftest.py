"""Test configuration: import guard and Hypothesis profiles."""

import os
import pathlib
import sys

import pytest
from hypothesis import HealthCheck, settings

import pagekv

_SOURCE_TREE = pathlib.Path(__file__).resolve().parents[1]

# Tests must exercise what `pip install` produced (compiled extension, pagekv.kernels mapped from
# kernels/), never the source folder by accident.
if pathlib.Path(pagekv.__file__).resolve().is_relative_to(_SOURCE_TREE):
    pytest.exit(
        f"expected pagekv imported from an installed copy, got {pagekv.__file__}: "
        "run `pip install .[test]` and `pytest` (not `python -m pytest`) from the repository",
        returncode=4,
    )

# Test helpers (kv_builders.py) import by name; only this folder joins sys.path, not the repository.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

settings.register_profile("default", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
# CI's second job (CPython 3.10 with numpy 1.x, kernels bounds-checked) looks for index errors and
# version breaks, not for new shapes: the main job's 100 examples found those, 30 here keep the
# whole CI run well under its 25 minutes on a 2-core AVX2 machine.
settings.register_profile("secondary", parent=settings.get_profile("ci"), max_examples=30)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
