"""Software prefetch of the next page of a sequence.

Hardware prefetchers follow a stream only within a 4 KiB memory page, and a paged KV cache jumps to
an unrelated address at every page boundary. While a kernel computes one page of a sequence, it asks
for the next page of that sequence's own page table, so the data is on its way when needed (the
design note prefetched physical page id + 1, which belongs to some other sequence, or to nobody).
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.extending import intrinsic

CACHE_LINE = 64


@intrinsic
def prefetch_address(typingctx, address):
    """Emit ``llvm.prefetch`` (read, keep in all cache levels) for an integer address."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
            ir.VoidType(), [i8p, i32, i32, i32]))
        pointer = builder.inttoptr(args[0], i8p)
        builder.call(fn, [pointer, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(address), codegen


@njit(cache=True, nogil=True, inline="always")
def prefetch_lines(cache, page, head, num_lines):
    """Prefetch the first ``num_lines`` cache lines of ``cache[page, head]``: enough to start the
    hardware prefetcher on a new region without flooding the miss queue."""
    start = cache.ctypes.data + page * cache.strides[0] + head * cache.strides[1]  # no view: no refcount
    for line in range(num_lines):
        prefetch_address(start + line * CACHE_LINE)
