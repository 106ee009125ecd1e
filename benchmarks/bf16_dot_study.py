"""Would AVX512-BF16 dot products lift bfloat16 decode? The query-key pass both ways, one core, from cache.

    python benchmarks/bf16_dot_study.py

On the CPUs measured the bfloat16 decode kernels are bound by float32 multiply-adds (README,
"Decode attention"): each K element feeds one FMA per query head of its GQA group. ``vdpbf16ps``
multiplies 32 bfloat16 pairs per instruction into 16 float32 sums — twice the products per
instruction — but takes the query rounded to bfloat16 (exact when the model's query is bfloat16
already). This study runs the query-key pass of one 4-head GQA group over 64 pages of 16 tokens x
head_dim 128 that sit in L2: pagekv's float32-math loop against a 4 x 2 register-blocked loop of
``vdpbf16ps`` written in LLVM IR (Numba's vectoriser cannot produce the instruction), and prints the
rates and the score error against float32 queries. Nothing in pagekv uses the bfloat16 path yet.
"""

import sys
import time

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels.attention import _page_scores
from pagekv.kernels._dtypes import FORMAT_BFLOAT16

F32X16 = ir.VectorType(ir.FloatType(), 16)
I32X16 = ir.VectorType(ir.IntType(32), 16)


class _BFloat(ir.types.Type):
    """LLVM's ``bfloat``: llvmlite.ir has no such type, and its IR is text, so one that prints so is enough."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


BF16X32 = ir.VectorType(_BFloat(), 32)


def _lane_sum(builder, vector):
    """Sum of a <16 x float>'s lanes by halving shuffles (four adds, not fifteen in a chain)."""
    width = 16
    while width > 1:
        half = width // 2
        mask_type = ir.VectorType(ir.IntType(32), half)
        low = builder.shuffle_vector(vector, vector, ir.Constant(mask_type, list(range(half))))
        high = builder.shuffle_vector(vector, vector, ir.Constant(mask_type, list(range(half, width))))
        vector = builder.fadd(low, high)
        width = half
    return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))


@intrinsic
def _dot_4x2(typingctx, q_address, q_stride, k0_address, k1_address, num_vectors):
    """The 8 dot products of 4 bfloat16 query rows (q_stride bytes apart) with 2 bfloat16 key rows,
    num_vectors * 32 elements each, float32 sums."""
    signature = types.UniTuple(types.float32, 8)(q_address, q_stride, k0_address, k1_address, num_vectors)

    def codegen(context, builder, sig, args):
        q_base, stride, k0_base, k1_base, count = args
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            F32X16, [F32X16, BF16X32, BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512")
        sums = [cgutils.alloca_once_value(builder, ir.Constant(F32X16, [0.0] * 16)) for _ in range(8)]
        with cgutils.for_range(builder, count) as loop:
            offset = builder.mul(loop.index, ir.Constant(loop.index.type, 64))

            def load(address):
                pointer = builder.inttoptr(builder.add(address, offset), I32X16.as_pointer())
                return builder.bitcast(builder.load(pointer, align=1), BF16X32)

            keys = load(k0_base), load(k1_base)
            for row in range(4):
                query = load(builder.add(q_base, builder.mul(stride, ir.Constant(stride.type, row))))
                for j, key in enumerate(keys):
                    builder.store(builder.call(dot, [builder.load(sums[2 * row + j]), query, key]),
                                  sums[2 * row + j])
        values = [_lane_sum(builder, builder.load(s)) for s in sums]
        return context.make_tuple(builder, sig.return_type, values)

    return signature, codegen


@njit(nogil=True)
def _scores_dp(q_bits, k_cache, page, head, num_tokens, scores):
    num_vectors = k_cache.shape[3] // 32
    base = k_cache.ctypes.data + page * k_cache.strides[0] + head * k_cache.strides[1]
    row = k_cache.strides[2]
    for t in range(0, num_tokens - 1, 2):
        s = _dot_4x2(q_bits.ctypes.data, q_bits.strides[0], base + t * row, base + (t + 1) * row,
                     num_vectors)
        for r in range(4):
            scores[r, t], scores[r, t + 1] = s[2 * r], s[2 * r + 1]


@njit
def _run_dp(q_bits, k_cache, scores, repeats):
    for _ in range(repeats):
        for page in range(k_cache.shape[0]):
            for head in range(k_cache.shape[1]):
                _scores_dp(q_bits, k_cache, page, head, k_cache.shape[2], scores)


@njit
def _run_float32_math(q, k_cache, scores, repeats):
    for _ in range(repeats):
        for page in range(k_cache.shape[0]):
            for head in range(k_cache.shape[1]):
                _page_scores(q, 0, 4, k_cache, page, head, FORMAT_BFLOAT16, k_cache.shape[2], scores,
                             0, k_cache, -1, 0)


def _bf16_bits(x):
    """float32 -> bfloat16 bit patterns, round to nearest even."""
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    if not llvm.get_host_cpu_features().get("avx512bf16"):
        sys.exit(f"this CPU ({llvm.get_host_cpu_name()}) has no AVX512-BF16: nothing to measure")
    rng = np.random.default_rng(0)
    k_cache = _bf16_bits(rng.standard_normal((8, 8, 16, 128), dtype=np.float32))  # 256 KiB: in L2
    q = rng.standard_normal((4, 128), dtype=np.float32)
    q_bits = _bf16_bits(q)
    keys = (k_cache.astype(np.uint32) << 16).view(np.float32)
    exact = q.astype(np.float64) @ keys[3, 2].T.astype(np.float64)
    for name, scores_of in (("float32 math", lambda out: _page_scores(
                                q, 0, 4, k_cache, 3, 2, FORMAT_BFLOAT16, 16, out, 0, k_cache, -1, 0)),
                            ("vdpbf16ps", lambda out: _scores_dp(q_bits, k_cache, 3, 2, 16, out))):
        out = np.zeros((4, 16), np.float32)
        scores_of(out)
        print(f"{name}: largest score error vs float64 {np.abs(out - exact).max():.2g} "
              f"(largest |score| {np.abs(exact).max():.3g})")
    scores = np.zeros((4, 16), np.float32)
    repeats = 300
    rates = {}
    for name, run in (("float32 math (pagekv today)", lambda: _run_float32_math(q, k_cache, scores, repeats)),
                      ("vdpbf16ps, 4 x 2 blocked", lambda: _run_dp(q_bits, k_cache, scores, repeats))):
        run()
        best = min(_timed(run) for _ in range(7))
        rates[name] = k_cache.size * repeats / best / 1e9
        print(f"{name}: {rates[name]:.2f} G key elements/s on one core")
    first, second = rates.values()
    print(f"ratio: {second / first:.2f}x")


def _timed(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
