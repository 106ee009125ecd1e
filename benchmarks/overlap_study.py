"""How much of a kernel's own work a software-prefetched memory stream hides on this machine.

    python benchmarks/overlap_study.py [--rounds 8]

A synthetic kernel reads 512 MiB as 4 KiB blocks (a bfloat16 page of 16 tokens x 128 dims) in
the order the AMX decode visits them (chunks of 16 random pages of 8 heads, head by head), and
per block prefetches the block ``distance`` blocks ahead into L2, then runs ``work`` passes of
FMAs over the block (the first from L2, the rest from L1). Its prefetches go out three ways: a
block's 64 lines at once, a KiB between the passes' quarters, or 256 bytes at a time. Each work
level runs from memory (the last-level cache evicted before every run) and "from L2" (every block
mapped onto the first 512 KiB: the same instructions, no memory traffic), in rounds alternating
with the streaming-read roof (benchmarks/paired.py: each variant paired with a roof run,
which of the two goes first alternating).

If memory and work overlapped perfectly, the kernel would read min(roof, its L2 speed); the
table puts what it reads beside that. The attention kernels' ceiling is this machine's, not only
their own: see docs/performance.md, "Decode from memory against the roof".
"""

import argparse

import numba
import numpy as np
from numba import njit, prange

from attention_cases import streaming_read
from paired import paired_times
from pagekv.kernels.prefetch import CACHE_LINE, prefetch_address

BLOCK_FLOATS = 1024  # 4 KiB
HEADS, CHUNK_PAGES = 8, 16
SPREADS = {"a block at once": 0, "a KiB at a time": 1, "256 B at a time": 2}
RESIDENT_BLOCKS = 128  # 512 KiB


@njit(parallel=True, fastmath=True)
def read_blocks(data, order, distance, work, spread):
    """Sum data's blocks in ``order`` (int64 [num_slots, visits], a row per thread) with ``work``
    FMA passes each, prefetching the block ``distance`` visits ahead as ``spread`` says
    (SPREADS)."""
    partial = np.zeros(order.shape[0])
    for slot in prange(order.shape[0]):
        lanes = np.zeros(256, np.float32)
        visits = order.shape[1]
        for i in range(visits):
            ahead = data[order[slot, i + distance]].ctypes.data if i + distance < visits else np.uintp(0)
            if spread == 0 and ahead != 0:
                for line in range(64):
                    prefetch_address(ahead + line * CACHE_LINE)
            block = order[slot, i]
            for k in range(work):
                for quarter in range(4):
                    if spread == 1 and k == 0 and ahead != 0:
                        for line in range(16):
                            prefetch_address(ahead + quarter * 1024 + line * CACHE_LINE)
                    for part in range(4):
                        if spread == 2 and k == 0 and ahead != 0:
                            for line in range(4):
                                prefetch_address(ahead + quarter * 1024 + part * 256 + line * CACHE_LINE)
                        base = quarter * 256 + part * 64
                        for j in range(64):
                            lanes[part * 64 + j] = lanes[part * 64 + j] * np.float32(0.999) + data[block, base + j]
        partial[slot] = lanes.sum()
    return partial.sum()


def decode_order(num_blocks, num_slots, rng):
    """Block numbers in the AMX decode's visit order: per chunk of CHUNK_PAGES random pages, head
    by head; split evenly over num_slots threads."""
    pages = rng.permutation(num_blocks // HEADS)
    order = [page * HEADS + head for first in range(0, len(pages), CHUNK_PAGES)
             for head in range(HEADS) for page in pages[first:first + CHUNK_PAGES]]
    return np.array(order, np.int64).reshape(num_slots, -1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--distance", type=int, default=16, help="prefetch distance in blocks")
    parser.add_argument("--work", default="1,2,4", help="FMA passes per block, comma-separated")
    args = parser.parse_args()
    roof, roof_bytes = streaming_read()
    evict, _ = streaming_read(3 << 28)  # 768 MiB: more than any last-level cache here
    data = np.ones(((1 << 29) // (4 * BLOCK_FLOATS), BLOCK_FLOATS), np.float32)
    memory = decode_order(len(data), numba.get_num_threads(), np.random.default_rng(0))
    resident = memory % RESIDENT_BLOCKS
    print("| FMA passes | from L2, % of roof | spread | from memory, % of roof | perfect overlap |")
    print("|---|---|---|---|---|")
    for work in (int(w) for w in args.work.split(",")):
        runs = {("L2", spread): (resident, spread) for spread in SPREADS.values()}
        runs.update({("memory", spread): (memory, spread) for spread in SPREADS.values()})
        shares = {}
        for name, (order, spread) in runs.items():
            def run(order=order, spread=spread):
                read_blocks(data, order, args.distance, work, spread)

            run()
            seconds, roof_seconds = paired_times(run, roof, args.rounds, before_each=evict)
            shares[name] = data.nbytes / seconds / (roof_bytes / roof_seconds)
        for label, spread in SPREADS.items():
            cached = float(np.median(shares[("L2", spread)]))
            read = float(np.median(shares[("memory", spread)]))
            print(f"| {work} | {100 * cached:.0f}% | {label} | {100 * read:.0f}% | {100 * min(1.0, cached):.0f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
