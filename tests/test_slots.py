"""Slots claimed by threads as they come free (kernels/slots.py): every slot once, whatever the
threads' speeds; and attention is the same however many slots a plan cuts."""

import numba
import numpy as np
import pytest

from kv_builders import PagedKV, slots_per_thread
from pagekv import attention
from pagekv.kernels import slots


@numba.njit(parallel=True)
def _claim_all(num_slots, num_threads, claims, owner):
    """Every thread claims slots until none is left; claims[n] counts the claims of slot n,
    owner[n] is the last thread that took it."""
    counter = slots.new_counter()
    for t in numba.prange(num_threads):
        slot = slots.claim(counter)
        while slot < num_slots:
            claims[slot] += 1  # no two threads hold one slot, so no race here
            owner[slot] = t
            slot = slots.claim(counter)


def test_every_slot_is_claimed_once_across_threads():
    """A plain load-add-store counter hands some numbers to both threads under contention (and
    skips none), so slots would run twice; the atomic one never does."""
    num_slots = 400_000
    claims, owner = np.zeros(num_slots, np.int64), np.full(num_slots, -1, np.int64)
    threads = numba.get_num_threads()
    _claim_all(num_slots, threads, claims, owner)
    assert np.all(claims == 1)
    assert set(np.unique(owner)) <= set(range(threads))


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
@pytest.mark.parametrize("per_thread", [1, 3, 16])
def test_attention_is_the_same_for_any_slot_count(kind, per_thread):
    """Decode and prefill with plans of 1, 3 and 16 slots per thread (more slots than sequences:
    some slots are empty) against the one-slot plan of one thread, which splits nothing."""
    rng = np.random.default_rng(5)
    kv = PagedKV(rng, [700, 1, 33, 2100], num_kv_heads=2, head_dim=64, page_size=16, kind=kind)
    q = rng.standard_normal((4, 4, 64)).astype(np.float32)
    with slots_per_thread(1):
        whole = attention.plan_decode(kv.seq_lens, page_size=16, num_threads=1)
    with slots_per_thread(per_thread):
        plan = attention.plan_decode(kv.seq_lens, page_size=16)
        prefill_q = rng.standard_normal((40, 4, 64)).astype(np.float32)
        indptr = np.array([0, 10, 11, 20, 40], np.int32)
        cut = attention.paged_prefill_attention(prefill_q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                indptr)
    assert len(whole.split_seqs) == 0
    a = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, plan=whole,
                                         fast_bf16=False)
    b = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, plan=plan,
                                         fast_bf16=False)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    with slots_per_thread(1):
        uncut = attention.paged_prefill_attention(prefill_q, kv.k, kv.v, kv.block_table,
                                                  kv.seq_lens, indptr)
    np.testing.assert_array_equal(cut, uncut)  # prefill items are never split: same sums
