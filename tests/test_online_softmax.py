"""The online softmax's fold of one chunk (kernels/online_softmax.py) against a float64 NumPy twin:
probabilities, running max, sum and accumulators, with causal and sliding-window masks that
leave a row all, some or none of a chunk's keys, soft caps and ALiBi slopes; and the fold that
writes bfloat16 probabilities in vectors (softmax_to_bf16, kernels/_softmax_ir.py) against the same
twin, at row lengths on both sides of its 16-lane vectors; and the AMX decode's fold down the
columns of its scores (16 query rows to a vector) into the value tiles' A rows."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv.kernels import amx_attention
from pagekv.kernels.online_softmax import softmax_to_bf16, softmax_update


def _fold_reference(scores, key0, qpos, masked, window, soft_cap, slopes, m, l, acc):
    """softmax_update in float64: masked keys set to -inf, then each row folded as a whole.
    Returns (probabilities, m, l, acc)."""
    s = scores.astype(np.float64)
    m, l, acc = m.astype(np.float64), l.astype(np.float64), acc.astype(np.float64)
    keys = key0 + np.arange(s.shape[1])
    if soft_cap > 0:
        s = soft_cap * np.tanh(s / soft_cap)
    if slopes.shape[0]:
        s = s + slopes[:, None].astype(np.float64) * (keys[None, :] - qpos[:, None])
    if masked:
        hidden = keys[None, :] > qpos[:, None]
        if window > 0:
            hidden |= keys[None, :] <= qpos[:, None] - window
        s = np.where(hidden, -np.inf, s)
    p = np.zeros_like(s)
    for r in range(s.shape[0]):
        top = s[r].max()
        if top == -np.inf:  # nothing to fold: the running state stays as it was
            continue
        new_max = max(m[r], top)
        alpha = np.exp(m[r] - new_max)
        p[r] = np.exp(s[r] - new_max)
        l[r] = l[r] * alpha + p[r].sum()
        m[r] = new_max
        acc[r] *= alpha
    return p, m, l, acc


@st.composite
def _chunks(draw):
    rows = draw(st.integers(1, 9))
    cols = draw(st.sampled_from([1, 2, 15, 16, 17, 33, 64, 65]))
    key0 = draw(st.integers(0, 80))
    # Query positions from before the chunk (every key masked) to past its end (none masked).
    qpos = np.array(draw(st.lists(st.integers(max(0, key0 - 3), key0 + cols + 3), min_size=rows,
                                  max_size=rows)), np.int64)
    window = draw(st.sampled_from([0, 1, 2, 7, 40, 1000]))
    first = draw(st.booleans())  # the first chunk: running max -inf, sum 0
    return rows, cols, key0, qpos, window, first


@settings(max_examples=150, deadline=None)
@given(chunk=_chunks(), masked=st.booleans(), soft_cap=st.sampled_from([0.0, 5.0]),
       alibi=st.booleans(), seed=st.integers(0, 2**16))
def test_fold_matches_float64(chunk, masked, soft_cap, alibi, seed):
    rows, cols, key0, qpos, window, first = chunk
    if not masked:  # the kernels fold unmasked only chunks that every row sees whole
        qpos = np.maximum(qpos, key0 + cols - 1)
        window = 0
    rng = np.random.default_rng(seed)
    head_dim = 16
    scores = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    slopes = rng.uniform(0.01, 0.5, rows).astype(np.float32) if alibi else np.empty(0, np.float32)
    if first:
        m, l = np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32)
    else:
        m = (3 * rng.standard_normal(rows)).astype(np.float32)
        l = rng.uniform(0.5, 9, rows).astype(np.float32)
    acc = rng.standard_normal((rows, head_dim)).astype(np.float32)
    expected = _fold_reference(scores, key0, qpos, masked, window, soft_cap, slopes, m, l, acc)

    softmax_update(scores, 0, rows, cols, key0, qpos, masked, window, soft_cap, slopes, m, l, acc)

    for got, want in zip((scores, m, l, acc), expected):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_fold_leaves_columns_past_the_chunk_alone():
    """Only the chunk's num_cols columns are touched (the scratch is wider than a short chunk)."""
    scores = np.full((2, 8), 7.0, np.float32)
    m, l, acc = np.full(2, -np.inf, np.float32), np.zeros(2, np.float32), np.ones((2, 4), np.float32)
    qpos = np.array([1, 10], np.int64)
    softmax_update(scores, 0, 2, 5, 0, qpos, True, 0, 0.0, np.empty(0, np.float32), m, l, acc)
    np.testing.assert_array_equal(scores[:, 5:], 7.0)
    np.testing.assert_allclose(scores[0, :5], [1, 1, 0, 0, 0])  # row 0 sees keys 0 and 1
    np.testing.assert_allclose(l, [2, 5])


def _bf16_values(bits):
    """float32 values of bfloat16 bit patterns (uint16)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


@settings(max_examples=150, deadline=None)
@given(chunk=_chunks(), cols=st.sampled_from([1, 15, 16, 17, 31, 33, 63, 64, 65, 97, 256]),
       scale=st.sampled_from([0.088, 1.0, -0.3]), seed=st.integers(0, 2**16))
def test_bf16_fold_matches_float64(chunk, cols, scale, seed):
    rows, _, key0, qpos, window, first = chunk
    qpos = np.minimum(qpos, key0 + cols + 3)
    rng = np.random.default_rng(seed)
    scale = np.float32(scale)
    scores = (30 * rng.standard_normal((rows, cols))).astype(np.float32)
    if first:
        m, l = np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32)
    else:
        m = (3 * rng.standard_normal(rows)).astype(np.float32)
        l = rng.uniform(0.5, 9, rows).astype(np.float32)
    acc = rng.standard_normal((rows, 16)).astype(np.float32)
    padded = -(-cols // 32) * 32
    probs = np.full((rows, padded + 5), 0xABCD, np.uint16)  # 5 columns past what it may write
    before = scores.copy()
    p, *state = _fold_reference(scores * scale, key0, qpos, True, window, 0.0, np.empty(0, np.float32),
                                m, l, acc)

    softmax_to_bf16(scores, rows, cols, key0, qpos, window, scale, m, l, acc, probs)

    np.testing.assert_array_equal(scores, before)
    got = _bf16_values(probs[:, :cols])
    np.testing.assert_allclose(got, p, rtol=2.0 ** -8, atol=1e-30)  # one bfloat16 rounding
    assert np.all(got[p == 0] == 0)  # masked keys
    np.testing.assert_array_equal(probs[:, cols:padded], 0)  # the value tiles read up to 32 keys
    np.testing.assert_array_equal(probs[:, padded:], 0xABCD)
    for got, want in zip((m, l, acc), state):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_bf16_fold_vectors_and_tail_agree():
    """A row's first 16 keys go through 16-lane vectors (vcvtneps2bf16 where the CPU has it), the
    rest of a 31-key row through scalar code (integer rounding): the same scores, the same bits."""
    rng = np.random.default_rng(7)
    lane = (20 * rng.standard_normal(16)).astype(np.float32)
    scores = np.concatenate([lane, lane[:15]])[None, :]
    m, l, acc = np.full(1, -np.inf, np.float32), np.zeros(1, np.float32), np.zeros((1, 1), np.float32)
    probs = np.zeros((1, 32), np.uint16)
    softmax_to_bf16(scores, 1, 31, 0, np.array([40]), 0, np.float32(0.7), m, l, acc, probs)
    np.testing.assert_array_equal(probs[0, 16:31], probs[0, :15])
    assert np.count_nonzero(probs[0, :15]) >= 3


@settings(max_examples=100, deadline=None)
@given(num_rows=st.sampled_from([1, 4, 7, 16, 17, 28, 32]),
       num_cols=st.sampled_from([1, 15, 16, 17, 100, 128]),
       ahead=st.sampled_from([0, 3, 100]), window=st.sampled_from([0, 1, 16, 40, 127, 200]),
       first=st.booleans(), scale=st.sampled_from([0.088, 1.0, -0.3]), seed=st.integers(0, 2**16))
def test_decode_column_fold_matches_float64(num_rows, num_cols, ahead, window, first, scale, seed):
    """The AMX decode's softmax down the score tiles' columns (amx_attention._columns_softmax,
    kernels/_softmax_ir.py strip_max and exp_to_pairs): the probabilities of query row q within one
    bfloat16 rounding of float64 in the A rows 2q (low halves) and 2q + 1 (high halves), 0 for
    the keys a sliding window masks (all of them where the query lies ``ahead`` of the chunk)
    and from num_cols to the next 16; the running max and sum folded."""
    rows, cols = -(-num_rows // 16) * 16, 128
    rng = np.random.default_rng(seed)
    scale = np.float32(scale)
    by_key = np.zeros((cols, rows), np.float32)  # the columns past num_rows 0, as decode keeps them
    by_key[:, :num_rows] = 30 * rng.standard_normal((cols, num_rows))
    by_key[num_cols:, :num_rows] = np.nan  # a tile's keys past the sequence: never read
    if first:
        m, l = np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32)
    else:
        m = (3 * rng.standard_normal(rows)).astype(np.float32)
        l = rng.uniform(0.5, 9, rows).astype(np.float32)
    m[num_rows:], l[num_rows:] = 0.0, 0.0
    scaled = by_key[:num_cols, :num_rows].T * scale  # float32, as the kernel rounds the product
    qpos = num_cols - 1 + ahead  # the chunk's keys start at position 0
    begin = max(0, qpos + 1 - window) if window else 0  # as decode takes it
    p, want_m, want_l, _ = _fold_reference(scaled, 0, np.full(num_rows, qpos), True, window, 0.0,
                                           np.empty(0, np.float32), m[:num_rows], l[:num_rows],
                                           np.zeros((num_rows, 1), np.float32))
    spread = np.full((2 * rows, cols), 0xDEADBEEF, np.uint32)

    amx_attention._columns_softmax(by_key, num_rows, begin, num_cols, scale, m, l,
                                   np.empty(rows, np.float32), spread)

    padded = -(-num_cols // 16) * 16
    even, odd = spread[0:2 * num_rows:2, :padded], spread[1:2 * num_rows:2, :padded]
    np.testing.assert_array_equal(even >> 16, 0)
    np.testing.assert_array_equal(odd, even << 16)
    got = _bf16_values(even[:, :num_cols].astype(np.uint16))
    np.testing.assert_allclose(got, p, rtol=2.0 ** -8, atol=1e-30)  # one bfloat16 rounding
    np.testing.assert_array_equal(got[:, :begin], 0)  # masked by the window
    np.testing.assert_array_equal(even[:, num_cols:], 0)  # the tiles take 16 keys at a time
    np.testing.assert_array_equal(spread[:, padded:], 0xDEADBEEF)
    np.testing.assert_allclose(m[:num_rows], want_m, rtol=1e-6)
    np.testing.assert_allclose(l[:num_rows], want_l, rtol=2e-5, atol=1e-6)
