"""The kernels' float32 math: the fastmath flags they compile with, a vectorising max, and a
vectorisable exp for the softmax.

``math.exp`` compiles to a call into libm per element, which LLVM cannot vectorise without a
vector math library; in the decode kernel those calls took ~40% of the compute. This is Cephes'
``expf`` (range reduction by ln 2, degree-6 polynomial, exponent built from bits): branch-free, so
the softmax loops vectorise. Accurate to about 1 ulp; exactly 0 below float32's range (and for -inf).
"""

from typing import Any

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.extending import intrinsic

# Not fastmath=True: that implies no-NaN/no-inf and would break -inf masking. These flags let LLVM
# reorder sums (vectorised dot products) and fuse multiply-adds, and nothing more.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
JIT: dict[str, Any] = dict(cache=True, fastmath=FASTMATH, error_model="numpy", nogil=True)


@intrinsic
def _bits_as_f32(typingctx, bits):
    """Reinterpret an int32 as float32 (no conversion)."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def fmax(typingctx, x, y):
    """max of two float32 by ``llvm.maxnum`` (a NaN operand loses), which LLVM vectorises as a
    reduction: Python's ``max`` and a compare-and-select stayed scalar chains of vmaxss."""
    if x != types.float32 or y != types.float32:
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32), codegen


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def fast_exp(x):
    """exp(x) for float32 x, branch-free."""
    clamped = min(max(x, np.float32(-87.33654)), np.float32(88.72283))
    n = np.floor(clamped * np.float32(1.44269504088896341) + np.float32(0.5))
    r = clamped - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    scaled = y * _bits_as_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    return scaled if x >= np.float32(-87.33654) else np.float32(0.0)
