"""Make the benchmark helpers (baselines.py, registry.py) importable under --import-mode=importlib.

Only this folder joins sys.path, never the repository root, so `pagekv` still comes from the
installed copy.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
