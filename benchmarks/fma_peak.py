"""The machine's multiply-add peaks on all threads: float32 FMAs, and bfloat16 pairs by
vdpbf16ps where the CPU has AVX512-BF16 (32 multiply-adds per instruction, the bfloat16 decode's
tiles there): how fast the attention loops' multiply-adds alone could run (``prefetch_study.py``'s
"multiply-adds alone at peak" and "from cache, % of the multiply-add peak" columns).

Numba's vectoriser keeps an array of accumulators in memory (a store and a load around every
multiply-add), so the loop is written as IR: CHAINS vector accumulators, each multiplied-and-added
in turn, independent of each other, enough to hide the FMA latency at two per cycle (4 cycles x 2
on AMD Zen 3). Measured on that EPYC: 5.4 G vector FMAs/s per core, as a C loop of the same
instructions measured. On the AMD EPYC Zen 4 (2 vCPUs): 106-115 GFMA/s float32 (one 16-lane FMA
per cycle and core) and 216 G bfloat16 multiply-adds/s (6.7 G vdpbf16ps/s, one per cycle and core).
"""

import time

import llvmlite.binding as llvm  # type: ignore[import-untyped]
import numba
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels import _tile_ir

CHAINS = 12
# float32 lanes of the widest vector register: AVX-512's 16, AVX2's 8 (a <16 x float> there takes
# two registers, and 24 would not fit in 16)
WIDTH = 16 if llvm.get_host_cpu_features().get("avx512f") else 8


def _chain_rounds(builder, count, lanes, step):
    """``count`` rounds of ``step(builder, accumulator)`` on each of CHAINS independent
    <lanes x float> accumulators (chain i starts at i); returns a lane of their sum (so the loop
    is not dropped)."""
    vector = ir.VectorType(ir.FloatType(), lanes)
    chains = [cgutils.alloca_once_value(builder, ir.Constant(vector, [float(i)] * lanes))
              for i in range(CHAINS)]
    with cgutils.for_range(builder, count):
        for chain in chains:
            builder.store(step(builder, builder.load(chain)), chain)
    total = builder.load(chains[0])
    for chain in chains[1:]:
        total = builder.fadd(total, builder.load(chain))
    return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))


@intrinsic
def _fma_chains(typingctx, count):
    """``count`` rounds of one FMA (x * 0.999999 + 1e-7) on each of CHAINS vector accumulators."""
    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), WIDTH)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{WIDTH}f32")
        scale, step = ir.Constant(vector, [0.999999] * WIDTH), ir.Constant(vector, [1e-7] * WIDTH)
        return _chain_rounds(builder, args[0], WIDTH, lambda b, acc: b.call(fma, [acc, scale, step]))

    return types.float32(count), codegen


@intrinsic
def _dot_pair_chains(typingctx, count):
    """``count`` rounds of one bfloat16-pairs product (vdpbf16ps where the CPU has it,
    kernels/_tile_ir.py's dot_pairs) on each of CHAINS accumulators: lanes += 1.0 * 1.0 + 0.5 *
    0.5."""
    def codegen(context, builder, signature, args):
        ones = ir.Constant(_tile_ir.I16X32, [0x3F80, 0x3F00] * _tile_ir.LANES)  # bfloat16 1.0, 0.5
        return _chain_rounds(builder, args[0], _tile_ir.LANES,
                             lambda b, acc: _tile_ir.dot_pairs(b, acc, ones, ones))

    return types.float32(count), codegen


@njit(parallel=True, cache=True, nogil=True)
def _on_every_thread(rounds, num_threads):
    total = 0.0
    for _ in prange(num_threads):
        total += _fma_chains(rounds)
    return total


@njit(parallel=True, cache=True, nogil=True)
def _dot_pairs_on_every_thread(rounds, num_threads):
    total = 0.0
    for _ in prange(num_threads):
        total += _dot_pair_chains(rounds)
    return total


def _best_time(run, rounds, repeats):
    threads = numba.get_num_threads()
    run(1, threads)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(rounds, threads)
        best = min(best, time.perf_counter() - start)
    return best


def fma_peak(*, rounds=20_000_000, repeats=5):
    """float32 multiply-adds per second on Numba's threads (best of ``repeats``)."""
    best = _best_time(_on_every_thread, rounds, repeats)
    return rounds * CHAINS * WIDTH * numba.get_num_threads() / best


def dot_pairs_peak(*, rounds=20_000_000, repeats=5):
    """bfloat16 multiply-adds per second by vdpbf16ps on Numba's threads (best of ``repeats``),
    or None where the CPU lacks AVX512-BF16 (there bfloat16 takes the float32 FMAs)."""
    if not _tile_ir.HAS_AVX512_BF16:
        return None
    best = _best_time(_dot_pairs_on_every_thread, rounds, repeats)
    return rounds * CHAINS * 2 * _tile_ir.LANES * numba.get_num_threads() / best


def multiply_add_peaks():
    """The multiply-add peaks of the decode tiles by KV dtype, each measured once: float32's FMAs,
    and bfloat16's vdpbf16ps pairs where bfloat16 takes them, else the same FMAs (a bfloat16 row
    is widened first). Returns {"float32": per second, "bfloat16": per second}."""
    fma = fma_peak()
    return {"float32": fma, "bfloat16": dot_pairs_peak() or fma}


if __name__ == "__main__":
    peak, pairs = fma_peak(), dot_pairs_peak()
    print(f"{peak / 1e9:.0f} GFMA/s float32 on {numba.get_num_threads()} threads "
          f"({peak / 1e9 / numba.get_num_threads() / WIDTH:.2f} G {WIDTH}-lane FMAs/s per thread)")
    if pairs is not None:
        print(f"{pairs / 1e9:.0f} G bfloat16 multiply-adds/s by vdpbf16ps "
              f"({pairs / 1e9 / numba.get_num_threads() / 32:.2f} G instructions/s per thread)")
