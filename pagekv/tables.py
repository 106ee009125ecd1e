"""Page-table formats: the padded block table the manager keeps, and what kernels of other engines
take (FlashInfer's CSR), plus the slot mapping of new tokens. Vectorised NumPy, no Python loops."""

import numpy as np

__all__ = ["csr_from_padded", "slots_of_last_tokens"]


def csr_from_padded(block_table, seq_lens, page_size):
    """FlashInfer's paged-KV CSR form of a padded block table.

    Parameters
    ----------
    block_table : int32 [num_seqs, max_pages]
    seq_lens : int32 [num_seqs]
    page_size : int

    Returns
    -------
    kv_indptr : int32 [num_seqs + 1]
        Sequence ``s`` owns ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``.
    kv_indices : int32 [total_pages]
    kv_last_page_len : int32 [num_seqs]
        Tokens in each sequence's last page (1..page_size; 0 for an empty sequence).

    Examples
    --------
    >>> import numpy as np
    >>> indptr, indices, last = csr_from_padded(np.array([[4, 2, 9], [7, 0, 0]]), np.array([9, 3]), 4)
    >>> indptr.tolist(), indices.tolist(), last.tolist()
    ([0, 3, 4], [4, 2, 9, 7], [1, 3])
    """
    lens = np.asarray(seq_lens, np.int64)
    num_pages = (lens + page_size - 1) // page_size
    indptr = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    used = np.arange(np.asarray(block_table).shape[1]) < num_pages[:, None]
    indices = np.asarray(block_table)[used].astype(np.int32)
    last = np.where(lens > 0, lens - (num_pages - 1) * page_size, 0).astype(np.int32)
    return indptr, indices, last


def slots_of_last_tokens(block_table, seq_lens, num_new_tokens, page_size):
    """Slots (``page * page_size + offset``) of each sequence's last ``num_new_tokens`` tokens.

    Parameters
    ----------
    block_table : int32 [num_seqs, max_pages]
    seq_lens : int32 [num_seqs]
    num_new_tokens : int or int array [num_seqs]
    page_size : int

    Returns
    -------
    int32 [sum(num_new_tokens)], sequence by sequence.
    """
    lens = np.asarray(seq_lens, np.int64)
    counts = np.asarray(num_new_tokens)
    # One check for every wrong value: a float, a wrong length, an int past int64 (object dtype).
    if (isinstance(num_new_tokens, bool) or counts.dtype.kind not in "iu"
            or counts.shape not in ((), lens.shape)
            or np.any(counts < 0) or np.any(counts > lens)):
        raise ValueError(f"expected num_new_tokens an int or one per sequence ({len(lens)}), each "
                         f"in [0, seq_len], got {num_new_tokens!r:.80} for lengths {str(lens.tolist()):.80}")
    counts = np.broadcast_to(counts.astype(np.int64), lens.shape)
    seq = np.repeat(np.arange(len(lens)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = lens[seq] - counts[seq] + offsets
    pages = np.asarray(block_table)[seq, positions // page_size].astype(np.int64)
    return (pages * page_size + positions % page_size).astype(np.int32)
