"""The machine's streaming-read bandwidth, measured the way the attention kernels read memory.

The benchmarks report attention throughput as a share of this number, measured in the same run with
the same thread count, so a figure means the same thing on any machine.
"""

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, nogil=True)
def stream_sum(data, num_slots):
    """Sum a float32 array with ``num_slots`` threads, each streaming one contiguous chunk."""
    chunk = (data.shape[0] + num_slots - 1) // num_slots
    partial = np.zeros(num_slots, np.float64)
    for slot in prange(num_slots):
        total = np.float32(0.0)
        for i in range(slot * chunk, min((slot + 1) * chunk, data.shape[0])):
            total += data[i]
        partial[slot] = total
    return partial.sum()
