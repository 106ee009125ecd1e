"""Slots claimed by threads as they come free (kernels/slots.py): every slot once, whatever the
threads' speeds. (That attention is the same however many slots a plan cuts is tested in
test_attention.py, whose worker compiles the kernels anyway.)"""

import numba
import numpy as np

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
