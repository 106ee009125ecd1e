"""Intel AMX tiles for bfloat16 attention: the tile instructions, as inline assembly.

Why: on CPUs with AMX (Intel Xeon since Sapphire Rapids) one ``tdpbf16ps`` multiplies a 16 x 32
bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums: 8,192 products per instruction.
Measured on this project's Intel Xeon VM (2 cores, 2.1 GHz): 1,134 G bfloat16 products per
second per core, against 34-42 G by AVX-512's ``vdpbf16ps`` (1.05-1.32 G instructions/s there,
no faster than float32 FMAs). Prefill, 16 query tokens x a GQA group per work item (64 rows for
S1's heads), is bound by those products; torch's SDPA, which takes AMX through oneDNN, ran 3.7x
faster than pagekv's ``vdpbf16ps`` prefill on that CPU.

Decode has a GQA group of query rows per KV head (4 at S1), a quarter of a tile's 16 rows. A
first decode on the prefill's tiles (query rows as A, value sums loaded and stored per page) ran
1.27-1.29x slower than the ``vdpbf16ps`` kernel. The decode kernel turns the scores around,
S^T = K Q^T: 16 keys as they lie in a page times the group's queries, and shapes its tiles to the
group (:func:`decode_configs`), so no product spends time on rows of zeros; the value sums stay
in tiles across a chunk of pages, visiting a chunk head by head.

Numba and llvmlite have no AMX types, and LLVM's AMX intrinsics need tile shapes it tracks
itself; so each instruction is emitted as inline assembly on fixed tile registers, and a kernel
loads the tile configuration (:func:`tile_config`) in each thread before its first tile instruction.
LLVM never allocates the tile registers on its own, so nothing else touches them between calls.
Every tile is 16 rows x 64 bytes (16 float32 or 32 bfloat16):

- scores, S = Q K^T per 16 query rows x 16 keys: A = 16 query rows (32 dims), B = 16 keys
  transposed into pairs of dims (``vnni``, by :func:`transpose_words`), C in tiles 4-7
  (up to four row groups at once, independent sums);
- values, O += P V. Prefill: B = 32 value rows interleaved in pairs of tokens (each word one
  dim of two tokens, once per chunk of pages), A = 16 rows' probabilities two tokens to a word:
  one product per 16 rows x 32 tokens x 16 dims (:func:`accumulate_pairs`). Decode reads each
  value row once, so it does not interleave them: B = 16 value rows as they lie in a page (32
  dims, 16 pairs of dims per row), A = the probabilities spread to even or to odd bfloat16 slots
  (zeros between), so each pair of dims meets one probability per token, the even dims summing
  in one C row and the odd ones in another (:func:`acc_dim`). With at most 8 query rows per set,
  decode stacks both spreads of a row in one A tile (two rows per query row), so one product per
  32 dims sums both (:func:`accumulate_stacked`): from L2 0.77-0.81x the time of two products per
  chunk in separate C tiles (S1), from memory 0.91-0.97x (S1, S2, G3, G7); a group of 9-16 (two
  sets: the same products and loads as before, plus the stacking) 1.07x. Prefill had taken that
  path too (two products per 16 rows, 16 tokens and 32 dims, half of them on zeros) until the
  interleaved values.
"""

import ctypes
import os
import sys

import llvmlite.binding as llvm  # type: ignore[import-untyped]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels._tile_ir import transposed
from pagekv.kernels.prefetch import CACHE_LINE, emit_prefetch

ROWS = 16  # rows of every tile: query rows of a group, keys, value rows
ROW_BYTES = 64  # bytes per tile row: 32 bfloat16 or 16 float32
CHUNK = 32  # bfloat16 dims per tile row
TILE_BYTES = ROWS * ROW_BYTES
GROUPS = 4  # row groups whose scores one key tile feeds at once (tiles 4-7)
SUM_TILES = 4  # tiles of value sums (4-7)
SET_ROWS = ROWS // 2  # decode's most query rows per A tile of values: two tile rows each
CONFIG_BYTES = 64
# Decode's prefetches go out from inside the tile instructions, a KiB per 32-dim chunk between the
# products (:func:`score_tiles`, :func:`accumulate_stacked`), not 64-128 lines in a row before them.
# Measured against that, AMX decode from memory (LLC evicted before each round, alternating rounds,
# medians of time ratios): S1 0.91-0.99x the time (five runs), S2 0.93-0.94x, G7 0.91-0.93x; from
# L2 0.93-1.00x. A guess at why (no performance counters on the VM): a burst of prefetches takes
# every fill buffer for a memory latency, and the tile loads, which miss L1 too, wait behind it.
PREFETCH_PER_CHUNK = ROWS * ROW_BYTES

_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl: ask Linux for an extended-state component
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64 (AMX is x86-64 only, so the CPU check comes first)


def _tile_data_permitted():
    """Ask Linux for AMX's tile state (needed once per process before any tile instruction,
    since Linux 5.16; without it the first one raises SIGILL). True when granted."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _available():
    """Linux, a CPU with AMX-TILE and AMX-BF16, the tile state granted, PAGEKV_AMX not "0"."""
    if os.environ.get("PAGEKV_AMX", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    features = llvm.get_host_cpu_features()
    return bool(features.get("amx-tile") and features.get("amx-bf16") and _tile_data_permitted())


# Whether the bfloat16 kernels may take AMX tiles: the CPU has AMX-BF16, Linux granted the tile
# state, and PAGEKV_AMX is not "0" (set it to compare against the vdpbf16ps tiles).
AVAILABLE = _available()
if AVAILABLE:
    llvm.initialize_native_asmparser()  # inline assembly needs the target's assembler parser

_VOID = ir.VoidType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _asm(builder, text, *operands):
    """Emit ``text`` (AT&T syntax, operands $0, $1, ... in registers) as a volatile asm
    statement that may read and write any memory."""
    constraints = ",".join(["r"] * len(operands) + ["~{memory}"])
    builder.asm(ir.FunctionType(_VOID, [o.type for o in operands]), text, constraints, list(operands),
                side_effect=True)


def _product(builder, c, a, b):
    """tile c += tile a x tile b (bfloat16 pairs into float32)."""
    _asm(builder, f"tdpbf16ps %tmm{b}, %tmm{a}, %tmm{c}")


def _i64(value):
    return ir.Constant(_I64, value)


@intrinsic
def configure(typingctx, address):
    """Load the tile configuration at ``address`` (64 bytes, :func:`tile_config`) in this thread."""
    def codegen(context, builder, signature, args):
        _asm(builder, "ldtilecfg ($0)", args[0])
        return context.get_dummy_value()

    return types.void(address), codegen


@intrinsic
def release(typingctx):
    """Return the tile state to its initial, empty state (so a thread switch saves no tiles)."""
    def codegen(context, builder, signature, args):
        _asm(builder, "tilerelease")
        return context.get_dummy_value()

    return types.void(), codegen


def _groups_switch(builder, groups, emit):
    """emit(n) under ``groups == n`` for n = 1..4: the tile registers an instruction names are
    fixed in its text, so each count of row groups gets its own code."""
    for n in range(1, GROUPS + 1):
        with builder.if_then(builder.icmp_signed("==", groups, ir.Constant(groups.type, n))):
            emit(n)


@intrinsic
def transpose_words(typingctx, source, source_step, target, target_step):
    """target word (k, n) = source word (n, k) for a 16 x 16 block of 32-bit words, by vector
    shuffles (:func:`pagekv.kernels._tile_ir.transposed`): rows source_step and target_step bytes apart.

    Prefill puts 16 keys in the score tiles' B layout with it, 32 dims at a time (word k of key n
    holds dims 2k and 2k + 1: moving the words one by one took ~25% of prefill's time); decode
    turns its scores, one key per row, into one query row per row.
    """
    signature = types.void(source, source_step, target, target_step)

    def codegen(context, builder, sig, args):
        source, source_step, target, target_step = args
        vector = ir.VectorType(_I32, ROWS)
        rows = []
        for n in range(ROWS):
            address = builder.add(source, builder.mul(source_step, _i64(n)))
            rows.append(builder.load(builder.inttoptr(address, vector.as_pointer()), align=2))
        for k, row in enumerate(transposed(builder, rows)):
            address = builder.add(target, builder.mul(target_step, _i64(k)))
            builder.store(row, builder.inttoptr(address, vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


def _prefetch_bytes(builder, block, start, size, into_l1=False):
    """Prefetch (into L2; into L1 too if ``into_l1``) ``size`` bytes (a multiple of a cache line)
    from ``start`` bytes into the block at address ``block``; nothing if it is 0. All three are i64
    values."""
    with builder.if_then(builder.icmp_unsigned("!=", block, ir.Constant(block.type, 0))):
        first = builder.add(block, start)
        with cgutils.for_range(builder, builder.udiv(size, _i64(CACHE_LINE))) as loop:
            emit_prefetch(builder, builder.add(first, builder.mul(loop.index, _i64(CACHE_LINE))), into_l1)


@intrinsic
def score_tiles(typingctx, queries, query_step, keys_t, groups, chunks, out, out_step, ahead, again):
    """out[16g + r, t] = queries[16g + r] . key t, for ``groups`` (1-4) groups of 16 query rows
    and 16 keys (float32, out_step bytes per row).

    queries : the first query row (bfloat16, query_step bytes per row); keys_t : the 16 keys in
    B's layout, ``chunks`` (head_dim / 32) tiles of 16 rows x 64 bytes one after another.
    ahead, again : addresses of ``chunks`` KiB to prefetch (decode: the 16 rows of a block it
    reads next, as bfloat16 rows of head_dim = 32 chunks lie), a KiB per chunk between the tile
    products, ``again`` (the near request) into L1 too; 0: none (see :data:`PREFETCH_PER_CHUNK`).
    """
    signature = types.void(queries, query_step, keys_t, groups, chunks, out, out_step, ahead, again)

    def codegen(context, builder, sig, args):
        queries, query_step, keys_t, groups, chunks, out, out_step, ahead, again = args
        group_bytes = builder.mul(query_step, _i64(ROWS))

        def emit(n):
            for g in range(n):
                _asm(builder, f"tilezero %tmm{4 + g}")
            with cgutils.for_range(builder, chunks) as loop:
                keys = builder.add(keys_t, builder.mul(loop.index, _i64(TILE_BYTES)))
                _asm(builder, "tileloadd ($0,$1,1), %tmm1", keys, _i64(ROW_BYTES))
                dims = builder.add(queries, builder.mul(loop.index, _i64(ROW_BYTES)))
                kib = builder.mul(loop.index, _i64(PREFETCH_PER_CHUNK))
                for g in range(n):
                    a = 0 if g % 2 == 0 else 2  # two A registers: a load need not wait for the last product
                    rows = builder.add(dims, builder.mul(group_bytes, _i64(g)))
                    _asm(builder, f"tileloadd ($0,$1,1), %tmm{a}", rows, query_step)
                    if g == 0:
                        _prefetch_bytes(builder, ahead, kib, _i64(PREFETCH_PER_CHUNK))
                    _product(builder, 4 + g, a, 1)
                _prefetch_bytes(builder, again, kib, _i64(PREFETCH_PER_CHUNK), True)
            out_group = builder.mul(out_step, _i64(ROWS))
            for g in range(n):
                _asm(builder, f"tilestored %tmm{4 + g}, ($0,$1,1)",
                     builder.add(out, builder.mul(out_group, _i64(g))), out_step)

        _groups_switch(builder, groups, emit)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def load_sums(typingctx, sums, tile_step, row_step, count):
    """Load ``count`` (1-4) tiles of value sums into tiles 4, 5, ...: tile 4 + i from address
    sums + i tile_step, its rows row_step bytes apart (float32)."""
    return types.void(sums, tile_step, row_step, count), _move_sums("tileloadd ($0,$1,1), %tmm{}")


@intrinsic
def store_sums(typingctx, sums, tile_step, row_step, count):
    """Store what :func:`load_sums` loaded, back where it came from."""
    return types.void(sums, tile_step, row_step, count), _move_sums("tilestored %tmm{}, ($0,$1,1)")


def _move_sums(text):
    def codegen(context, builder, sig, args):
        sums, tile_step, row_step, count = args
        for i in range(4):
            with builder.if_then(builder.icmp_unsigned(">", count, ir.Constant(count.type, i))):
                _asm(builder, text.format(4 + i), builder.add(sums, builder.mul(tile_step, _i64(i))), row_step)
        return context.get_dummy_value()

    return codegen


@intrinsic
def accumulate_pairs(typingctx, probs, prob_step, values, value_step, count):
    """Sums of :func:`load_sums` (tiles 4 .. 3 + count) += p x v for 16 rows and 32 tokens:
    prefill's values, tile 4 + i summing dims 16 i .. 16 i + 15 of the value rows given.

    probs : row 0's 32 probabilities, bfloat16 in token order (64 bytes), prob_step bytes per row;
    values : the 32 value rows interleaved in pairs of tokens (B's layout): row k holds, per dim,
    the word (token 2k, token 2k + 1), value_step bytes per row.
    """
    signature = types.void(probs, prob_step, values, value_step, count)

    def codegen(context, builder, sig, args):
        probs, prob_step, values, value_step, count = args
        _asm(builder, "tileloadd ($0,$1,1), %tmm0", probs, prob_step)
        for i in range(SUM_TILES):
            b = 2 + i % 2  # two B registers: a load need not wait for the last product
            with builder.if_then(builder.icmp_unsigned(">", count, ir.Constant(count.type, i))):
                _asm(builder, f"tileloadd ($0,$1,1), %tmm{b}", builder.add(values, _i64(i * ROW_BYTES)), value_step)
                _product(builder, 4 + i, 0, b)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def accumulate_stacked(typingctx, probs, set_step, prob_step, sets, values, value_step, chunks, ahead,
                       again, span):
    """Value sums in tiles 4-7 += p x v for 16 tokens (decode): ``sets`` (1 or 2) sets of up to 8
    query rows times ``chunks`` (at most 4 // sets) 32-dim chunks of the value rows, one tile
    product per set and chunk, into tile 4 + chunk * sets + set.

    probs : set 0's A tile (set 1's set_step bytes on), two rows per query row: its 16
    probabilities in the even bfloat16 slots (the odd ones 0), then in the odd slots (prob_step
    bytes per row); values : token 0's first dim (bfloat16, value_step bytes per token). A sum
    tile then holds, per query row, the chunk's even dims in one row and its odd dims in the next
    (:func:`acc_dim`'s order within 32). ahead, again : as in :func:`score_tiles`, ``span`` bytes
    of each (a multiple of four cache lines), in equal parts after each chunk's products.
    """
    signature = types.void(probs, set_step, prob_step, sets, values, value_step, chunks, ahead, again, span)

    def codegen(context, builder, sig, args):
        probs, set_step, prob_step, sets, values, value_step, chunks, ahead, again, span = args

        def emit(num_sets):
            for a in range(num_sets):
                _asm(builder, f"tileloadd ($0,$1,1), %tmm{a}", builder.add(probs, builder.mul(set_step, _i64(a))),
                     prob_step)
            parts = SUM_TILES // num_sets
            part = builder.udiv(span, _i64(parts))
            for c in range(parts):
                b = 2 + c % 2  # two B registers: a load need not wait for the last products
                with builder.if_then(builder.icmp_unsigned(">", chunks, ir.Constant(chunks.type, c))):
                    _asm(builder, f"tileloadd ($0,$1,1), %tmm{b}", builder.add(values, _i64(c * ROW_BYTES)),
                         value_step)
                    for a in range(num_sets):
                        _product(builder, 4 + c * num_sets + a, a, b)
                offset = builder.mul(part, _i64(c))
                _prefetch_bytes(builder, ahead, offset, part)
                _prefetch_bytes(builder, again, offset, part, True)

        for num_sets in (1, 2):
            with builder.if_then(builder.icmp_signed("==", sets, ir.Constant(sets.type, num_sets))):
                emit(num_sets)
        return context.get_dummy_value()

    return signature, codegen


@njit(cache=True, nogil=True)
def _set_tile(config, tile, rows, row_bytes):
    """Tile ``tile`` of a configuration: ``rows`` rows of ``row_bytes`` bytes (a little-endian
    uint16 at byte 16 + 2 tile, the rows at byte 48 + tile)."""
    config[16 + 2 * tile] = row_bytes & 0xFF
    config[17 + 2 * tile] = row_bytes >> 8
    config[48 + tile] = rows


@njit(cache=True, nogil=True)
def tile_config():
    """The 64-byte tile configuration: palette 1, eight tiles of 16 rows x 64 bytes."""
    config = np.zeros(CONFIG_BYTES, np.uint8)
    config[0] = 1
    for tile in range(8):
        _set_tile(config, tile, ROWS, ROW_BYTES)
    return config


@njit(cache=True, nogil=True)
def decode_configs(group):
    """Decode's two tile configurations (uint8 [2, 64]) for a GQA group of ``group`` (1-16) query
    rows, so that no tile product spends time on rows of zeros:

    0. scores, S^T = K Q^T: tile 0 (A) 16 key rows x 64 bytes as they lie in a page, tile 1 (B)
       16 pairs of dims x ``group`` queries, tile 4 (C) 16 keys x ``group`` float32
       (:func:`score_tiles` with one row group);
    1. values: tiles 0, 1 (A, the probabilities) and 4-7 (the sums) two rows per query row of a
       set of up to :data:`SET_ROWS` (the group in one set, or two) x 64 bytes, tiles 2, 3 (B,
       value rows) 16 x 64 bytes (:func:`accumulate_stacked`).
    """
    configs = np.zeros((2, CONFIG_BYTES), np.uint8)
    configs[:, 0] = 1
    _set_tile(configs[0], 0, ROWS, ROW_BYTES)
    _set_tile(configs[0], 1, ROWS, 4 * group)
    _set_tile(configs[0], 4, ROWS, 4 * group)
    for tile in range(8):
        _set_tile(configs[1], tile, ROWS if tile in (2, 3) else 2 * value_set_rows(group), ROW_BYTES)
    return configs


@njit(cache=True, nogil=True)
def value_sets(group):
    """How many sets of query rows decode's value tiles take a GQA group of ``group`` in (1 or 2)."""
    return -(-group // SET_ROWS)


@njit(cache=True, nogil=True)
def value_set_rows(group):
    """Query rows per set of decode's value tiles (the last set may hold fewer)."""
    return -(-group // value_sets(group))


@njit(cache=True, nogil=True, inline="always")
def acc_dim(j):
    """The dimension that position j of an accumulator row holds: in each 32, the 16 even
    dims, then the 16 odd ones (:func:`accumulate_stacked`'s two rows)."""
    base, k = j - j % CHUNK, j % CHUNK
    return base + 2 * k if k < CHUNK // 2 else base + 2 * (k - CHUNK // 2) + 1
