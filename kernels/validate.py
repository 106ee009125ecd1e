"""Checks that the attention wrappers run before trusting a page table: one pass, no temporaries."""

from numba import njit


@njit(cache=True, nogil=True)
def first_bad_page(block_table, seq_lens, page_size, num_pages):
    """(seq, logical page) of the first page id outside [0, num_pages) among the pages in use, or
    (-1, -1). Entries past a sequence's length are padding and are not looked at."""
    for s in range(seq_lens.shape[0]):
        for p in range((seq_lens[s] + page_size - 1) // page_size):
            page = block_table[s, p]
            if page < 0 or page >= num_pages:
                return s, p
    return -1, -1
