"""Numba's thread pool as pagekv starts it: OpenMP with nested parallelism left off.

Why: Numba's "omp" threading layer switches nested parallel regions on (``omp_set_nested(1)``)
when it starts, in the GNU OpenMP runtime it links, the system's ``libgomp.so.1.0.0``. A PyTorch
wheel bundles its own libgomp under the same soname (``libgomp.so.1``), so a torch imported after
Numba's layer started shares Numba's runtime, and torch's nested parallel loops then oversubscribe
the cores. Measured here (2 cores, torch 2.13.0): torch's bfloat16 ``scaled_dot_product_attention``
of 128 queries over 2K keys took 1.2 s instead of 0.12 s, and any pagekv call made before
``import torch`` caused it. pagekv's kernels never nest, so the first call restores OpenMP's
default of one active level (unless OMP_MAX_ACTIVE_LEVELS or OMP_NESTED asks otherwise). A torch
imported before Numba's layer starts loads its own runtime, which this leaves alone.
"""

import ctypes
import os

import numba

# Numba's omppool links libgomp by this file name (its NEEDED entry), so this name finds the very
# runtime Numba uses, never a torch copy loaded under the soname libgomp.so.1.
NUMBA_LIBGOMP = "libgomp.so.1.0.0"
_started = False


def start():
    """Start Numba's threading layer, if no one has, with nested OpenMP parallelism off.

    Called before every parallel kernel launch; after the first call it only tests a flag.
    """
    global _started
    if _started:
        return
    numba.get_num_threads()  # starts the threading layer, as a parallel kernel's first call would
    _started = True
    if numba.threading_layer() == "omp" and not {"OMP_MAX_ACTIVE_LEVELS", "OMP_NESTED"} & set(os.environ):
        runtime = numba_libgomp()
        if runtime is not None:
            runtime.omp_set_max_active_levels(1)


def numba_libgomp():
    """The GNU OpenMP runtime Numba's "omp" layer runs on, if it is loaded (a ctypes library), or None."""
    from numba.np.ufunc import omppool  # type: ignore[attr-defined]  # a compiled module

    if omppool.openmp_vendor != "GNU" or not hasattr(os, "RTLD_NOLOAD"):
        return None
    try:
        return ctypes.CDLL(NUMBA_LIBGOMP, mode=os.RTLD_NOLOAD)  # only if already loaded
    except OSError:
        return None
