"""Work planning for the attention kernels: balanced work items, built once per step.

Each *slot* owns a run of work items, and the kernels' threads claim slots one after another as
they come free (kernels/slots.py; the callers ask for SLOTS_PER_THREAD slots per thread). The
slots' costs are balanced here: the decode planner lays every sequence's pages end to end and
cuts that line into ``num_slots`` runs of equal cost, splitting a long sequence across slots where
a cut falls inside it (flash-decoding). A split sequence's pieces are merged by log-sum-exp
afterwards.
"""

import numpy as np
from numba import njit


ITEM_OVERHEAD = 1  # cost of starting a work item (loading q, writing out), in pages


@njit(cache=True, nogil=True)
def plan_decode(seq_lens, page_size, window, num_slots, min_chunk):
    """Cut every sequence's pages into balanced work items for ``decode`` (all KV heads per item).

    Parameters
    ----------
    seq_lens : int32 [num_seqs]
    page_size, window, num_slots, min_chunk : int
        ``window`` 0 means no sliding window; ``min_chunk`` is the fewest pages a split piece gets.

    Returns
    -------
    items : int32 [num_items, 4]
        (seq, page_begin, page_end, part); ``part`` -1 for an unsplit sequence.
    slot_indptr : int32 [num_slots + 1]
    split_seqs : int32 [num_split, 3]
        (seq, part_begin, part_end) of each split sequence.
    num_parts : int
    """
    num_seqs = seq_lens.shape[0]
    first = np.empty(num_seqs, np.int64)
    last = np.empty(num_seqs, np.int64)
    total = 0
    for s in range(num_seqs):
        last[s] = (seq_lens[s] + page_size - 1) // page_size
        first[s] = max(seq_lens[s] - window, 0) // page_size if window > 0 else 0
        first[s] = min(first[s], last[s])
        total += last[s] - first[s] + ITEM_OVERHEAD
    total += (num_slots - 1) * ITEM_OVERHEAD  # each cut between slots may add one piece
    # Each slot's quota is what is left divided by the slots left, so a slot that closes a little
    # early (rather than cut a sliver) pushes its shortfall onto all later slots, not the last one.
    consumed = 0
    quota = max(min_chunk + ITEM_OVERHEAD, (total + num_slots - 1) // num_slots)

    items = np.empty((num_seqs + 2 * num_slots, 4), np.int32)
    slot_of = np.empty(items.shape[0], np.int64)
    split_seqs = np.empty((num_slots + 1, 3), np.int32)
    num_items = num_parts = num_split = 0
    slot = fill = 0
    for s in range(num_seqs):
        begin, end = first[s], last[s]
        seq_start = num_items
        while True:
            remaining = end - begin
            room = quota - fill - ITEM_OVERHEAD
            if slot == num_slots - 1 or remaining <= room:
                take = remaining
            elif room < min_chunk:
                slot += 1  # this slot is full: start the next one
                fill = 0
                quota = max(min_chunk + ITEM_OVERHEAD,
                            (total - consumed + num_slots - slot - 1) // (num_slots - slot))
                continue
            else:
                take = room if remaining - room >= min_chunk else remaining
            items[num_items, 0] = s
            items[num_items, 1] = begin
            items[num_items, 2] = begin + take
            items[num_items, 3] = -1
            slot_of[num_items] = slot
            num_items += 1
            fill += take + ITEM_OVERHEAD
            consumed += take + ITEM_OVERHEAD
            begin += take
            if fill >= quota and slot < num_slots - 1:
                slot += 1
                fill = 0
                quota = max(min_chunk + ITEM_OVERHEAD,
                            (total - consumed + num_slots - slot - 1) // (num_slots - slot))
            if begin >= end:
                break
        if num_items - seq_start > 1:
            split_seqs[num_split, 0] = s
            split_seqs[num_split, 1] = num_parts
            for i in range(seq_start, num_items):
                items[i, 3] = num_parts
                num_parts += 1
            split_seqs[num_split, 2] = num_parts
            num_split += 1
    slot_indptr = np.zeros(num_slots + 1, np.int32)
    for i in range(num_items):
        slot_indptr[slot_of[i] + 1] += 1
    for i in range(num_slots):
        slot_indptr[i + 1] += slot_indptr[i]
    return items[:num_items].copy(), slot_indptr, split_seqs[:num_split].copy(), num_parts


@njit(cache=True, nogil=True)
def plan_prefill(seq_lens, qo_indptr, page_size, num_kv_heads, window, num_slots, block):
    """Cut every sequence's query rows into blocks of ``block`` per KV head, balanced by cost.

    Returns
    -------
    items : int32 [num_items, 4]
        (seq, kv_head, row_begin, row_end).
    slot_indptr : int32 [num_slots + 1]
    """
    num_seqs = seq_lens.shape[0]
    count = 0
    for s in range(num_seqs):
        count += (qo_indptr[s + 1] - qo_indptr[s] + block - 1) // block * num_kv_heads
    items = np.empty((count, 4), np.int32)
    cost = np.empty(count, np.int64)
    n = 0
    for s in range(num_seqs):
        first_pos = seq_lens[s] - (qo_indptr[s + 1] - qo_indptr[s])
        for h in range(num_kv_heads):
            for row in range(qo_indptr[s], qo_indptr[s + 1], block):
                row_end = min(row + block, qo_indptr[s + 1])
                low = first_pos + row - qo_indptr[s]
                high = first_pos + row_end - 1 - qo_indptr[s]
                page_begin = max(low - window + 1, 0) // page_size if window > 0 else 0
                items[n, 0] = s
                items[n, 1] = h
                items[n, 2] = row
                items[n, 3] = row_end
                cost[n] = (row_end - row) * (high // page_size + 1 - page_begin + ITEM_OVERHEAD)
                n += 1
    # Cut the running cost into num_slots equal runs (items are not split).
    slot_indptr = np.zeros(num_slots + 1, np.int32)
    total = 0
    for i in range(count):
        total += cost[i]
    running = 0
    slot = 0
    for i in range(count):
        while slot < num_slots - 1 and running >= (slot + 1) * total / num_slots:
            slot += 1
            slot_indptr[slot] = i
        running += cost[i]
    for j in range(slot + 1, num_slots + 1):
        slot_indptr[j] = count
    return items, slot_indptr
