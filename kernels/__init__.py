"""Numba kernels of pagekv, installed as ``pagekv.kernels`` (source folder ``kernels/``).

The kernels trust their input: shapes, dtypes and page ids are validated by the public wrappers in
``pagekv.attention``. Every kernel is compiled with ``cache=True``: the first call in a fresh
environment compiles (see :func:`warmup`), later processes load the cached machine code.
"""

import pathlib as _pathlib

from pagekv.kernels import _cache_dir
from pagekv.kernels._stale_cache import drop_stale_cache as _drop_stale_cache

__all__ = ["warmup"]

# Before any kernel is defined: a writable cache folder for Numba, cleared of machine code compiled
# from other sources (wherever it is: next to the kernels, under NUMBA_CACHE_DIR, or the fallback).
_cache_dir.ensure(_pathlib.Path(__file__).parent)
_drop_stale_cache(_pathlib.Path(__file__).parent, _cache_dir.kernels_cache(_pathlib.Path(__file__).parent))


def warmup(*, dtypes=("float32", "bfloat16"), head_dim=128, page_size=16, processes=None,
           progress=None):
    """Compile (or load from Numba's cache) the kernels for the given storage dtypes.

    Runs each public operation once on a tiny problem, so the first real call does not pay for
    compilation. Numba compiles on one core, one kernel after another; when the kernels are not in
    the on-disk cache yet, fresh interpreters compile them side by side (each writes the cache) and
    this process then loads them all. Returns the seconds it took.

    Parameters
    ----------
    dtypes : str or tuple of {"float32", "float16", "bfloat16", "float8_e4m3fn"}
        KV storage kinds to prepare; each has its own decode and prefill kernels (its own tiles).
    head_dim, page_size : int
        Only the tiny problem's shape: the kernels are compiled for any shape.
    processes : int, optional
        How many kernels compile at once on a cold cache: default one per CPU this process may
        run on (at most one per kernel); 1 compiles here, one after the other.
    progress : bool, optional
        A progress bar on stderr, one step per (operation, dtype): default only when something
        compiles (a cold compile of float32 and bfloat16 takes 1-3 min), True always, False never.
    """
    import time

    from pagekv.kernels import _warm

    if processes is not None and (not isinstance(processes, int) or processes < 1):
        raise ValueError(f"expected processes None or an int >= 1, got {processes!r}")
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"expected progress None, True or False, got {progress!r}")
    start = time.perf_counter()
    tasks = _warm.tasks(dtypes)
    workers = min(len(tasks), _warm.usable_cpus() if processes is None else processes)
    cold = not _warm.compiled({dtype for _, dtype in tasks}, head_dim, page_size)
    with _warm.progress_bar(len(tasks), disable=not (cold if progress is None else progress)) as bar:
        compiled_apart = workers > 1 and cold
        if compiled_apart:
            bar.set_postfix_str(f"compiling in {workers} interpreters")
            _warm.compile_in_subprocesses(tasks, workers, head_dim, page_size, done=bar.update)
        for op, kind in tasks:  # loads what the subprocesses compiled; compiles whatever they did not
            bar.set_postfix_str(f"{op} {kind}")
            _warm.run(op, kind, head_dim, page_size)
            bar.update(0 if compiled_apart else 1)
    return time.perf_counter() - start
