"""The machine's float32 multiply-add peak on all threads: how fast the attention loops' FMAs
alone could run (``prefetch_study.py``'s "FMAs at peak" column).

Numba's vectoriser keeps an array of accumulators in memory (a store and a load around every
multiply-add), so the loop is written as IR: CHAINS vector accumulators, each multiplied-and-added
in turn, independent of each other, enough to hide the FMA latency at two per cycle (4 cycles x 2
on AMD Zen 3). Measured on that EPYC: 5.4 G vector FMAs/s per core, as a C loop of the same
instructions measured.
"""

import time

import llvmlite.binding as llvm  # type: ignore[import-untyped]
import numba
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

CHAINS = 12
# float32 lanes of the widest vector register: AVX-512's 16, AVX2's 8 (a <16 x float> there takes
# two registers, and 24 would not fit in 16)
WIDTH = 16 if llvm.get_host_cpu_features().get("avx512f") else 8


@intrinsic
def _fma_chains(typingctx, count):
    """``count`` rounds of one FMA on each of CHAINS vector accumulators; returns a lane of
    their sum (so the loop is not dropped)."""
    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), WIDTH)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{WIDTH}f32")
        scale, step = ir.Constant(vector, [0.999999] * WIDTH), ir.Constant(vector, [1e-7] * WIDTH)
        chains = [cgutils.alloca_once_value(builder, ir.Constant(vector, [float(i)] * WIDTH))
                  for i in range(CHAINS)]
        with cgutils.for_range(builder, args[0]):
            for chain in chains:
                builder.store(builder.call(fma, [builder.load(chain), scale, step]), chain)
        total = builder.load(chains[0])
        for chain in chains[1:]:
            total = builder.fadd(total, builder.load(chain))
        return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))

    return types.float32(count), codegen


@njit(parallel=True, cache=True, nogil=True)
def _on_every_thread(rounds, num_threads):
    total = 0.0
    for _ in prange(num_threads):
        total += _fma_chains(rounds)
    return total


def fma_peak(*, rounds=20_000_000, repeats=5):
    """float32 multiply-adds per second on Numba's threads (best of ``repeats``)."""
    threads = numba.get_num_threads()
    _on_every_thread(1, threads)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _on_every_thread(rounds, threads)
        best = min(best, time.perf_counter() - start)
    return rounds * CHAINS * WIDTH * threads / best


if __name__ == "__main__":
    peak = fma_peak()
    print(f"{peak / 1e9:.0f} GFMA/s float32 on {numba.get_num_threads()} threads "
          f"({peak / 1e9 / numba.get_num_threads() / WIDTH:.2f} G {WIDTH}-lane FMAs/s per thread)")
