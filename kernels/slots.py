"""Slots handed to threads as they come free: one shared counter per kernel call.

The planners (kernels/plan.py) cut a step's work into slots of equal cost. With one slot per thread,
balance rests on every thread running at the same speed, and they do not: on the 2-vCPU AMD EPYC
VM (Zen 3) one thread ran 10-20% slower than the other for seconds at a time (the host's other
load), so the faster one waited in libgomp for 13-17% of each S1 decode call (perf, 2 threads,
pages in cache). Numba's ``prange`` hands out iterations statically (its OpenMP layer calls
``GOMP_parallel``, no dynamic schedule), so the kernels take their slots themselves: each thread
runs one ``prange`` iteration that claims slot after slot from an atomic counter until none is
left, and the planners make SLOTS_PER_THREAD slots per thread, so a thread that frees up early
takes over work a slow one would have done; the wait left is at most one slot.
"""

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.extending import intrinsic

# Slots per thread: the most a thread can wait is one slot, 1 / (SLOTS_PER_THREAD * threads) of a
# call; more slots split more long sequences (flash-decoding pieces, merged afterwards).
SLOTS_PER_THREAD = 4


@intrinsic
def _fetch_add(typingctx, counter):
    """counter[0] += 1 atomically; returns the value before. counter : int64 [1], C-contiguous."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


@njit(inline="always", cache=True, nogil=True)
def new_counter():
    """A fresh slot counter for one kernel call (int64 [1], zero): slots are claimed from 0."""
    return np.zeros(1, np.int64)


@njit(inline="always", cache=True, nogil=True)
def claim(counter):
    """The next unclaimed slot of this call (every thread gets each number once, in order)."""
    return _fetch_add(counter)
