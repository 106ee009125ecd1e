"""Software prefetch of the K/V blocks an attention kernel reads next.

Why: the attention loops do enough arithmetic per cache line that the core's out-of-order window
reaches only a few token rows ahead, and the hardware prefetchers do not make up for it (they stop
at 4 KiB boundaries, and a paged cache jumps to an unrelated address at every page). Measured on
S1 decode with one thread: 34% of the streaming-read bandwidth from memory, against the same loops
running at 87% of it from cache — compute and memory were not overlapped at all. So the kernels ask
for a block further down their own visit order while they compute the current one: a steady
stream of prefetches, a few lines per token row, into L2. (The design note prefetched physical
page id + 1, which belongs to some other sequence, or to nobody.)

Decode's tiles (bfloat16 and float32 pages, head_dim a multiple of 16) ask for each line
twice: far ahead (64 KiB by default, 16 KiB with AVX2's tiles: pagekv/attention.py,
PREFETCH_BYTES) and again a short way ahead (an eighth of that). Why it
helps is not measured here (this VM has no performance counters); the likely reason: a prefetch
is only a hint, and AMD's Zen 4 is reported to drop prefetcht1 requests now and then (Wang et
al., "The Hitchhiker's Guide to Programming and Optimizing CXL-Based Heterogeneous Systems",
2024), so a dropped line became a demand miss that stalled the core, and the stream of
prefetches with it; the second request catches such lines in time. Measured, alternating rounds with the
caches flushed: bfloat16 decode 1.07-1.10x faster at S1/S2/S3 and 1.03-1.15x at other GQA and
MHA shapes, float32 MHA 1.02-1.19x; the extra instructions cost 6-26% when the pages are in
cache. Numba's loops (float16 pages, other head_dims) and prefill ask once: it gained 0-2%
from memory (measured on the loops over float32 GQA pages, which then were decode's path) or
lost 1-4% (prefill, compute-bound), and cost 9-13% from cache. On the Intel Xeon the second
request paid too (AMX decode from memory, S1: 1.10x the time without it); there the near one
goes into L1 (below), and the AMX decode sends both from inside its tile instructions
(kernels/_amx.py).
"""

import llvmlite.binding as llvm  # type: ignore[import-untyped]
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.extending import intrinsic

CACHE_LINE = 64
MEMORY_PAGE = 4096  # the smallest page of the OS (and of a VM host): prime_pages
# llvm.prefetch locality 2 = prefetcht1: into L2, not L1. Blocks arrive a few KiB before they are
# read; in L1 (locality 3) they evicted the rows being computed and the stream gained nothing.
# Decode's second, near request (a few KiB ahead) does go into L1 (prefetcht0). Measured on the
# Intel Xeon, alternating rounds: AMX decode from memory 0.94-1.00x the time (S1 0.97, 0.99, 1.00;
# S2 0.94, 0.95; G3 1.00), from L2 0.92x; the vdpbf16ps and float32 tiles from memory 0.94-0.98x
# (S1/S2/S3 float32, S3/G2 bfloat16), from L2 0.85x (S1 float32) and 0.92x (S3 bfloat16).
_LOCALITY_L2 = 2
_LOCALITY_L1 = 3
# Except on AMD's Zen 4, where the near request into L1 costs what it gains on the Xeon (and a
# second request into L1 had gained nothing there before, docs/performance.md): processes
# alternating, from memory, near into L2 ÷ into L1 time: bfloat16 0.90-0.98 (S1 0.92, S2 0.92,
# S3 0.90-0.96, G3/G7/G8 0.92-0.98; two runs), float32 0.89-1.03 (S1 0.96, S2 0.94-0.98, S3
# 0.89-0.98); from L2 S1/G8 0.97-1.03 but S3 1.10-1.11; prefill 0.99-1.02. Decode runs from
# memory, so L2. Zen 5 is assumed to behave alike; the Zen 3 (AVX2) was tuned with the near
# request in L1 and keeps it there, unmeasured the other way.
_NEAR_REQUEST_IN_L2 = ("znver4", "znver5")
NEAR_INTO_L1 = llvm.get_host_cpu_name() not in _NEAR_REQUEST_IN_L2


def emit_prefetch(builder, address, into_l1=False):
    """Emit ``llvm.prefetch`` (read, into L2; into L1 too if ``into_l1``) of an integer address with
    an llvmlite builder."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
        ir.VoidType(), [i8p, i32, i32, i32]))
    locality = _LOCALITY_L1 if into_l1 else _LOCALITY_L2
    builder.call(fn, [builder.inttoptr(address, i8p), i32(0), i32(locality), i32(1)])


@intrinsic
def prefetch_address(typingctx, address):
    """Emit ``llvm.prefetch`` (read, into L2) for an integer address. Never faults."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        emit_prefetch(builder, args[0])
        return context.get_dummy_value()

    return types.void(address), codegen


@njit(cache=True, nogil=True, inline="always")
def block_address(cache, page, head):
    """Address of block ``cache[page, head]`` (no view: no refcount); 0 when page < 0 (no block)."""
    if page < 0:
        return 0
    return cache.ctypes.data + page * cache.strides[0] + head * cache.strides[1]


@njit(cache=True, nogil=True, inline="always")
def prime_pages(start, nbytes):
    """Prefetch the first line of each 4 KiB memory page that ``[start, start + nbytes)`` touches
    (``start`` itself in the first); nothing if ``start`` is 0.

    Why: the first touch of a 4 KiB page costs more than the lines after it (a guess: the walk of
    the VM host's page tables, or the hardware prefetcher starting over), and in random page order
    a kernel's stream makes that first touch every block. Asking for it further ahead than the
    per-line requests takes it off their path. A plain sum over random 32 KiB chunks, each line
    requested 64 KiB ahead, read 78% of the roof, 86-87% with this 96-128 KiB ahead (Intel Xeon,
    docs/performance.md, 2026-12-05).
    """
    if start == 0:
        return
    end = start + nbytes
    line = start
    while line < end:
        prefetch_address(line)
        line += MEMORY_PAGE - line % MEMORY_PAGE


@njit(cache=True, nogil=True, inline="always")
def prefetch_rows(block, row_bytes, row, num_rows):
    """Prefetch token rows ``row .. row + num_rows - 1`` (of ``row_bytes`` each) of the block at
    address ``block``; nothing if it is 0."""
    if block == 0:
        return
    start = block + row * row_bytes
    for offset in range(0, num_rows * row_bytes, CACHE_LINE):  # no view: no refcount
        prefetch_address(start + offset)
