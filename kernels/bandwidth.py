"""The machine's streaming-read bandwidth, measured the way the attention kernels read memory.

The benchmarks report attention throughput as a share of this number, measured in the same run with
the same thread count, so a figure means the same thing on any machine.
"""

import numpy as np
from numba import njit, prange

# Independent accumulators, i.e. bytes in flight per loop iteration: on 2 cores 16 lanes read
# 14-29 GB/s, 64 lanes 36, 256 lanes 52-56 (numpy .sum() on two threads: 34.5).
LANES = 256


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, nogil=True)
def stream_sum(data, num_slots):
    """Sum a 1-D float32 array with ``num_slots`` threads, each streaming one contiguous chunk.

    The tail past a multiple of ``num_slots * LANES`` elements is ignored (a few bytes).
    """
    rows = data.shape[0] // (num_slots * LANES)
    blocks = data[:rows * num_slots * LANES].reshape(num_slots, rows, LANES)
    partial = np.zeros(num_slots, np.float64)
    for slot in prange(num_slots):
        lanes = np.zeros(LANES, np.float32)
        block = blocks[slot]
        for i in range(rows):
            for j in range(LANES):
                lanes[j] += block[i, j]
        partial[slot] = lanes.sum()
    return partial.sum()
