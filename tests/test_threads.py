"""pagekv starts Numba's OpenMP layer without nested parallelism (pagekv/kernels/threads.py says why).

Each case runs in a fresh interpreter: the OpenMP state is per process and the first parallel call
decides it.
"""

import os
import subprocess
import sys

import pytest

# Runs a parallel function of the test's own first (Numba's layer starts and switches nesting on),
# then one pagekv operation, and prints the runtime's active levels before and after.
SCRIPT = """
import numba, numpy as np
from pagekv import attention
from pagekv.kernels import threads

@numba.njit(parallel=True)
def total(a):
    s = 0.0
    for i in numba.prange(a.shape[0]):
        s += a[i]
    return s

total(np.ones(64))
gnu = numba.threading_layer() == "omp" and threads.numba_libgomp() is not None
before = threads.numba_libgomp().omp_get_max_active_levels() if gnu else None
o = np.ones((1, 1, 16), np.float32)
out, _ = attention.merge_states(o, np.zeros((1, 1), np.float32), o, np.zeros((1, 1), np.float32))
assert (out == 1).all()
print(before, threads.numba_libgomp().omp_get_max_active_levels() if gnu else numba.threading_layer())
"""


def run_script(**env):
    """(levels before, after) in GNU OpenMP; (None, the layer's name) on any other layer."""
    result = subprocess.run([sys.executable, "-I", "-c", SCRIPT], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split()
    return (None, after) if before == "None" else (int(before), int(after))


def skip_unless_gnu(before):
    if before is None:
        pytest.skip("Numba's threading layer here is not GNU OpenMP")


def test_first_kernel_call_turns_nesting_off():
    before, after = run_script()
    skip_unless_gnu(before)
    assert before > 1  # Numba's layer switched nested regions on ...
    assert after == 1  # ... and pagekv's first call switched them off


def test_an_explicit_openmp_setting_is_left_alone():
    before, after = run_script(OMP_MAX_ACTIVE_LEVELS="4")
    skip_unless_gnu(before)
    assert after == before


def test_other_threading_layers_run_unchanged():
    assert run_script(NUMBA_THREADING_LAYER="workqueue") == (None, "workqueue")
