"""Checks that the attention wrappers run before trusting a page table: one pass, no temporaries."""

from numba import njit

OK, NEGATIVE_LENGTH, PAST_CAPACITY, BAD_PAGE = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def first_bad_entry(block_table, seq_lens, page_size, num_pages):
    """The first problem in the page tables, as (problem, seq, logical page): NEGATIVE_LENGTH or
    PAST_CAPACITY (seq_lens[seq] < 0, or more tokens than block_table's row holds; page -1),
    BAD_PAGE (a page id in use outside [0, num_pages)), or (OK, -1, -1). Entries past a sequence's
    length are padding and are not looked at.

    One compiled pass instead of NumPy's min, max and a loop: the checks run on every attention
    call, so their fixed cost counts for short contexts.
    """
    capacity = block_table.shape[1] * page_size
    for s in range(seq_lens.shape[0]):
        if seq_lens[s] < 0:
            return NEGATIVE_LENGTH, s, -1
        if seq_lens[s] > capacity:
            return PAST_CAPACITY, s, -1
        for p in range((seq_lens[s] + page_size - 1) // page_size):
            page = block_table[s, p]
            if page < 0 or page >= num_pages:
                return BAD_PAGE, s, p
    return OK, -1, -1
