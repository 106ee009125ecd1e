"""A decode step's memory traffic without its arithmetic: a plain sum of the pages the decode kernel
reads, in the order it reads them, with its prefetch stream.

On random page order and on the same pages laid out consecutively it measures what the page jumps
cost the memory system by itself: the floor under the decode kernel's own paged ÷ contiguous
time (bench_attention.py, prefetch_study.py).
"""

import numba
import numpy as np

from pagekv.attention import PREFETCH_AGAIN_FRACTION, PREFETCH_BYTES, plan_decode
from pagekv.kernels.attention import CHUNK_TOKENS
from pagekv.kernels.bandwidth import LANES
from pagekv.kernels.prefetch import CACHE_LINE, block_address, prefetch_address


@numba.njit(parallel=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def visit_sum(k_pages, v_pages, visits, slot_indptr, ahead_bytes, again_bytes=0):
    """Sum whole pages in a given visit order, each slot on its own thread, prefetching
    ``ahead_bytes`` down that order as the kernels do (a line per line read; 0: no prefetch), and
    again ``again_bytes`` down it as decode's tiles do (0: not).

    k_pages, v_pages : float32 arrays whose [page] is one C-contiguous page (a K/V cache seen as
    float32 words, a page of every head; words a multiple of LANES); visits : int64
    [num_visits, 2] = (0 for K or 1 for V, physical page); slot_indptr : int64 [num_slots + 1].
    """
    words = k_pages[0].size
    page_bytes = words * 4
    partial = np.zeros(slot_indptr.shape[0] - 1)
    for slot in numba.prange(slot_indptr.shape[0] - 1):
        lanes = np.zeros(LANES, np.float32)
        end = slot_indptr[slot + 1]
        for i in range(slot_indptr[slot], end):
            rows = (v_pages if visits[i, 0] else k_pages)[visits[i, 1]].reshape(words // LANES, LANES)
            for j in range(words // LANES):
                for distance in (ahead_bytes, again_bytes):
                    offset = j * LANES * 4 + distance
                    ahead = i + offset // page_bytes
                    if distance > 0 and ahead < end:
                        pages = v_pages if visits[ahead, 0] else k_pages
                        start = block_address(pages, visits[ahead, 1], 0) + offset % page_bytes
                        for line in range(0, LANES * 4, CACHE_LINE):
                            prefetch_address(start + line)
                for lane in range(LANES):
                    lanes[lane] += rows[j, lane]
        partial[slot] = lanes.sum()
    return partial.sum()


def visit_order_sum(p, *, contiguous=False):
    """:func:`visit_sum` over p's pages in the order the decode kernel reads them (per thread slot
    its items, per item its chunks of CHUNK_TOKENS, per chunk the K pages then the V pages), with
    the decode tiles' two prefetch distances; on p's consecutive pages if ``contiguous``."""
    page_size = p.k_cache.shape[2]
    table = p.contiguous_table if contiguous else p.block_table
    k_pages, v_pages = (p.k_contiguous, p.v_contiguous) if contiguous else (p.k_cache, p.v_cache)
    plan = plan_decode(p.seq_lens, page_size=page_size)
    chunk = max(1, CHUNK_TOKENS // page_size)
    visits, indptr = [], [0]
    for slot in range(len(plan.slot_indptr) - 1):
        for seq, begin, end, _ in plan.items[plan.slot_indptr[slot]:plan.slot_indptr[slot + 1]]:
            for first in range(begin, end, chunk):
                pages = table[seq, first:min(first + chunk, end)]
                visits += [(0, page) for page in pages] + [(1, page) for page in pages]
        indptr.append(len(visits))
    visits, indptr = np.array(visits, np.int64), np.array(indptr, np.int64)
    k, v = k_pages.view(np.float32), v_pages.view(np.float32)
    again = PREFETCH_BYTES // PREFETCH_AGAIN_FRACTION
    return lambda: visit_sum(k, v, visits, indptr, PREFETCH_BYTES, again)
