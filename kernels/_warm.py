"""The work of :func:`pagekv.kernels.warmup`: each public operation once on a tiny problem, and
fresh interpreters that compile the kernels side by side when Numba's on-disk cache lacks them.

Numba compiles one kernel at a time on one core, and the kernels are independent: a cold
``warmup()`` of float32 and bfloat16 took 127-161 s in one process on the 2-vCPU Zen 3 VM, and
67-111 s with two interpreters compiling at once (docs/performance.md, "Compile time"). Each
interpreter writes Numba's cache; the caller then loads every kernel from it. Fresh interpreters,
not ``multiprocessing``: its spawned workers re-run the caller's main module, which a script
without an ``if __name__ == "__main__"`` guard cannot survive.
"""

import logging
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from pagekv._arrays import KV_FORMAT

DTYPES = tuple(KV_FORMAT)  # the storage kinds the kernels take
OPERATIONS = ("decode", "prefill", "ops")
LOGGER = logging.getLogger("pagekv")
_announced: set = set()  # ids of the dispatchers announce_compile has looked at


def tasks(dtypes):
    """(operation, dtype) pairs for ``dtypes`` (one name or several), the long compiles (decode,
    prefill) first."""
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"expected dtypes among {', '.join(DTYPES)}, got {dtype!r}")
    return [(op, dtype) for op in OPERATIONS for dtype in dict.fromkeys(dtypes)]


def usable_cpus():
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tiny_cache(dtype, head_dim, page_size):
    """A 3-page, 2-head cache of ``dtype`` (bfloat16 as uint16 bits, float8_e4m3fn as uint8 bits):
    [3, 2, page_size, head_dim]."""
    cache = np.random.default_rng(0).standard_normal((3, 2, page_size, head_dim)).astype(np.float32)
    if dtype == "bfloat16":
        return (cache.view(np.uint32) >> 16).astype(np.uint16)
    if dtype == "float8_e4m3fn":
        from pagekv.kernels.convert import narrow_e4m3

        bits = np.empty(cache.shape, np.uint8)
        narrow_e4m3(cache.reshape(-1), bits.reshape(-1))
        return bits
    return cache.astype(dtype)


def run(op, dtype, head_dim, page_size):
    """Call the kernels of ``op`` for ``dtype`` once: compiles them, or loads them from the cache."""
    from pagekv import attention

    cache = tiny_cache(dtype, head_dim, page_size)
    query_dtype = {"float16": np.float16, "bfloat16": np.uint16}.get(dtype, np.float32)
    q = np.ones((2, 4, head_dim), query_dtype)  # a 16-bit query compiles its conversions too
    table = np.array([[0, 1], [2, 0]], np.int32)
    lens = np.array([page_size + 1, 3], np.int32)
    if op == "decode":
        attention.paged_decode_attention(q, cache, cache, table, lens)
        one_head = np.ascontiguousarray(cache[:, :1])  # a GQA group of 4: the AMX decode, where present
        attention.paged_decode_attention(q, one_head, one_head, table, lens)
    elif op == "prefill":
        attention.paged_prefill_attention(q, cache, cache, table, lens, np.array([0, 1, 2], np.int32))
    else:
        attention.write_kv(cache[0, :, :2].transpose(1, 0, 2).copy(),
                           cache[1, :, :2].transpose(1, 0, 2).copy(), cache, cache.copy(),
                           np.array([5, -1]))
        attention.copy_pages(cache, cache.copy(), [0], [2])
        attention.gather_kv(cache, cache, table, lens)
        o = np.zeros((1, 1, head_dim), np.float32)
        attention.merge_states(o, np.zeros((1, 1), np.float32), o, np.zeros((1, 1), np.float32))


def compiled(dtypes, head_dim, page_size):
    """Whether Numba's on-disk cache holds, for this CPU, a decode and a prefill kernel for each
    of ``dtypes`` (the storage's own, or AMX's where it serves bfloat16). Read from Numba's cache
    index (its internals): anything unexpected answers True, and warmup then compiles in this
    process as it did before interpreters shared the work."""
    try:
        from pagekv import _arrays, attention
        from pagekv.kernels import amx_attention
        from pagekv.kernels import attention as kernels
        from pagekv.kernels.page_loops import kernel_kind

        dot_products = attention._bf16_products(True)
        for dtype in dtypes:
            cache, kv_format = tiny_cache(dtype, head_dim, page_size), _arrays.KV_FORMAT[dtype]
            kind = kernel_kind(cache, kv_format, dot_products)
            amx = amx_attention.applies(cache, kv_format, dot_products)
            decode = [kernels._DECODE[kind]] + ([amx_attention.decode] if amx else [])
            prefill = [kernels._PREFILL[kind]] + ([amx_attention.prefill] if amx else [])
            if not (any(map(_in_cache, decode)) and any(map(_in_cache, prefill))):
                return False
        return True
    except Exception:  # noqa: BLE001 -- a Numba without these internals: compile here, as before
        return True


def _in_cache(dispatcher):
    """Whether ``dispatcher``'s on-disk cache index lists machine code for this CPU and this very
    function: a key is (signature, CPU, (bytecode hash, closure hash)), and the kernels of every
    storage kind share one index file (one closure, other cells)."""
    cache = dispatcher._cache
    wanted = cache._index_key(None, dispatcher.targetctx.codegen())[1:]
    return any(key[1:] == wanted for key in cache._cache_file._load_index())


def announce_compile(dispatcher, kind, operation):
    """Log a warning (once per kernel and process) when the call about to run ``dispatcher`` (the
    ``operation`` kernel of storage ``kind``) will compile it: nothing compiled or loaded in this
    process yet, and nothing for this CPU in Numba's disk cache. A decode or prefill kernel
    compiles for 20-60 s, which a caller would otherwise take for a hang. Python's logging prints
    warnings on stderr unless told otherwise (``logging.getLogger("pagekv")``). Costs a set
    lookup once the kernel is known."""
    if id(dispatcher) in _announced:
        return
    _announced.add(id(dispatcher))
    if dispatcher.signatures:
        return
    try:
        cached = _in_cache(dispatcher)
    except Exception:  # noqa: BLE001 -- a Numba without these internals: say nothing
        return
    if not cached:
        LOGGER.warning("pagekv: compiling the %s kernel for this CPU, once: about a minute (Numba "
                       "keeps it on disk for later processes; pagekv.kernels.warmup() compiles "
                       "ahead of time)", f"{kind} {operation}")


def progress_bar(total, *, disable):
    """A progress bar on stderr over ``total`` (operation, dtype) tasks (``.update()`` per task)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, desc="pagekv kernels", unit="task", disable=disable, file=sys.stderr,
                leave=False)


def compile_in_subprocesses(task_list, workers, head_dim, page_size, *, done=lambda: None):
    """Run :func:`run` for each task in a fresh interpreter, ``workers`` at a time, calling
    ``done()`` as each ends. A failed interpreter costs only its time: the caller then compiles
    what is missing itself."""
    import pagekv

    # `python -c` puts its working directory first on sys.path: the folder that holds the pagekv
    # imported here, so the interpreters compile this pagekv's kernels, not a checkout's.
    root = pathlib.Path(pagekv.__file__).resolve().parents[1]

    def compile_one(task):
        op, dtype = task
        code = f"from pagekv.kernels import _warm; _warm.run({op!r}, {dtype!r}, {head_dim}, {page_size})"
        try:
            subprocess.run([sys.executable, "-c", code], cwd=root, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
        except OSError:  # no usable interpreter (an embedded Python): compiled by the caller
            pass

    with ThreadPoolExecutor(workers) as pool:
        for _ in as_completed([pool.submit(compile_one, task) for task in task_list]):
            done()
