"""The attention wrappers' boundary: each mistake raises "expected X, got Y", never crashes."""

import numpy as np
import pytest

from kv_builders import PagedKV
from pagekv import InvalidPageError, attention
from wrong_values import MUTATIONS, READ_ONLY, refusal_problem


@pytest.fixture
def kv():
    return PagedKV(np.random.default_rng(0), [20, 5], num_kv_heads=2, head_dim=64, page_size=16,
                   kind="float32")


def decode(kv, **changes):
    args = dict(q=np.zeros((2, 4, 64), np.float32), k_cache=kv.k, v_cache=kv.v,
                block_table=kv.block_table, seq_lens=kv.seq_lens)
    options = {name: changes.pop(name) for name in list(changes) if name not in args}
    args.update(changes)
    return attention.paged_decode_attention(**args, **options)


@pytest.mark.parametrize("bad", [-1, 6, 10**6])
def test_page_id_outside_the_cache(kv, bad):
    table = kv.block_table.copy()
    table[0, 1] = bad
    with pytest.raises(InvalidPageError, match=rf"expected page ids in \[0, 6\), got {bad} at block_table\[0, 1\]"):
        decode(kv, block_table=table)


def test_padding_past_the_length_is_not_read(kv):
    table = kv.block_table.copy()
    table[1, 1:] = 10**6  # sequence 1 uses one page only
    decode(kv, block_table=table)


def test_seq_len_beyond_the_table(kv):
    with pytest.raises(ValueError, match=r"expected seq_lens <= 48 .* got 49 for sequence 1"):
        decode(kv, seq_lens=np.array([20, 49], np.int32))


@pytest.mark.parametrize("changes, error, message", [
    (dict(q=np.zeros((2, 3, 64), np.float32)), ValueError,
     "num_q_heads a positive multiple of num_kv_heads 2, got 3"),
    (dict(q=np.zeros((2, 0, 64), np.float32)), ValueError, "multiple of num_kv_heads 2, got 0"),
    (dict(q=np.zeros((2, 4, 32), np.float32)), ValueError, "head_dim 64 .* got 32"),
    (dict(q=np.zeros((2, 4), np.float32)), ValueError, r"expected q of shape \[num_tokens"),
    (dict(q=np.zeros((3, 4, 64), np.float32)), ValueError, "for 3 sequences, got 2 and 2"),
    (dict(q=np.zeros((2, 4, 64), np.int32)), TypeError, "expected float32, float16 or bfloat16 .* got int32"),
    (dict(seq_lens=np.array([20.0, 5.0])), TypeError, "expected an integer dtype for seq_lens"),
    (dict(seq_lens=np.array([20, -1])), ValueError, "expected seq_lens >= 0, got -1"),
    (dict(block_table=np.zeros(4, np.int32)), ValueError, "expected a 2-D array for block_table"),
    (dict(sliding_window=0), ValueError, "expected sliding_window None or an integer >= 1, got 0"),
    (dict(logits_soft_cap=-1.0), ValueError, "expected logits_soft_cap None or > 0"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"expected alibi_slopes of shape \(4,\)"),
    (dict(alibi_slopes=np.array([0.5, np.nan, 0.25, 0.125], np.float32)), ValueError,
     r"expected finite alibi_slopes within float32's range, got nan \(as float32\) at index 1"),
    (dict(alibi_slopes=[0.5, 0.25, 1e40, 0.1]), ValueError, r"got inf \(as float32\) at index 2"),
    (dict(scale=float("nan")), ValueError, "expected a finite scale"),
    (dict(scale=1e40), ValueError, "expected a finite scale within float32's range, got 1e"),
    (dict(scale="1"), TypeError, "expected scale a real number, got '1'"),
    (dict(sliding_window="2"), ValueError, "expected sliding_window None or an integer >= 1, got '2'"),
    (dict(sliding_window=2.0), ValueError, "expected sliding_window None or an integer >= 1, got 2.0"),
    (dict(logits_soft_cap=True), TypeError, "expected logits_soft_cap a real number, got True"),
    (dict(logits_soft_cap=1e39), ValueError, "expected logits_soft_cap None or > 0 within float32"),
    (dict(return_lse="yes"), ValueError, "expected return_lse a bool, got 'yes'"),
    (dict(plan=1), TypeError, "expected plan None or a DecodePlan from plan_decode, got int"),
    (dict(out=np.zeros((2, 4, 64), np.float16)), ValueError, "expected out float32"),
    (dict(out=np.zeros((2, 4, 128), np.float32)[..., ::2]), ValueError, "C-contiguous"),
    (dict(prefetch=-1), ValueError, "expected prefetch a bool or a number of bytes >= 0, got -1"),
    (dict(prefetch=2.5), ValueError, "expected prefetch a bool or a number of bytes >= 0, got 2.5"),
    (dict(k_scale=0), ValueError, "expected k_scale None or a number > 0 within float32's range, got 0"),
    (dict(v_scale=float("nan")), ValueError, "expected v_scale None or a number > 0 .* got nan"),
    (dict(v_scale="1"), TypeError, "expected v_scale a real number, got '1'"),
    (dict(scale=1e30, k_scale=1e10), ValueError, "expected scale \\* k_scale within float32's range"),
])
def test_bad_arguments(kv, changes, error, message):
    with pytest.raises(error, match=message):
        decode(kv, **changes)


def test_a_plan_not_made_by_plan_decode_is_refused(kv):
    """The kernels trust a plan's work items: one built by hand could send them anywhere."""
    import dataclasses

    plan = attention.plan_decode(kv.seq_lens, page_size=16)
    forged = dataclasses.replace(plan, items=plan.items + 1000)
    with pytest.raises(TypeError, match="expected plan None or a DecodePlan from plan_decode, "
                                        "got one made elsewhere"):
        decode(kv, plan=forged)
    decode(kv, plan=plan)


def test_plan_for_other_lengths_is_refused(kv):
    plan = attention.plan_decode([20, 6], page_size=16)
    with pytest.raises(ValueError, match="expected a plan made for these seq_lens"):
        decode(kv, plan=plan)
    decode(kv, plan=attention.plan_decode(kv.seq_lens, page_size=16))


@pytest.mark.parametrize("qo_indptr, message", [
    ([0, 4], "for 1 sequences, got 2 and 2"),
    ([1, 2, 4], "expected qo_indptr nondecreasing from 0 to 4"),
    ([0, 3, 2, 4], "expected qo_indptr nondecreasing"),
    ([0, 0, 4], r"expected seq_lens\[1\] >= its 4 query tokens, got 0"),
])
def test_prefill_bad_qo_indptr(qo_indptr, message):
    kv = PagedKV(np.random.default_rng(1), [8, 0], num_kv_heads=1, head_dim=64, page_size=4,
                 kind="float32")
    q = np.zeros((4, 1, 64), np.float32)
    with pytest.raises(ValueError, match=message):
        attention.paged_prefill_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, qo_indptr)


def test_merge_states_shapes():
    o = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"expected lse_b of shape \(2, 3\), got \(2,\)"):
        attention.merge_states(o, np.zeros((2, 3)), o, np.zeros(2))
    with pytest.raises(ValueError, match="expected o_a and o_b of one 3-D shape"):
        attention.merge_states(o, np.zeros((2, 3)), o[:1], np.zeros((1, 3)))
    with pytest.raises(TypeError, match="expected a float array for lse_b, got <U1"):
        attention.merge_states(o, np.zeros((2, 3)), o, np.full((2, 3), "x"))


def test_cache_writers_refuse_read_only_caches(kv):
    """A read-only cache (np.load(mmap_mode="r"), a frozen array) is refused before any write."""
    k, v = kv.k.copy(), kv.v.copy()
    v.setflags(write=False)
    with pytest.raises(ValueError, match="expected a writeable v_cache, got a read-only array"):
        attention.write_kv(np.ones((1, 2, 64), np.float32), np.ones((1, 2, 64), np.float32), k, v, [0])
    with pytest.raises(ValueError, match="expected a writeable v_cache, got a read-only array"):
        attention.copy_pages(k, v, [0], [1])
    np.testing.assert_array_equal(k, kv.k)  # nothing written to the writeable one either


@pytest.mark.parametrize("axis, name", [(1, "num_kv_heads"), (2, "page_size"), (3, "head_dim")])
def test_a_cache_with_an_empty_axis_is_refused(kv, axis, name):
    empty = np.zeros(kv.k.shape[:axis] + (0,) + kv.k.shape[axis + 1:], np.float32)
    with pytest.raises(ValueError, match=r"expected k_cache with num_kv_heads, page_size and "
                                         rf"head_dim >= 1, got shape \({empty.shape[0]}, "):
        decode(kv, k_cache=empty, v_cache=empty)


def test_a_cache_of_no_pages_serves_empty_sequences():
    cache = np.zeros((0, 2, 16, 64), np.float32)
    out, lse = attention.paged_decode_attention(
        np.ones((2, 4, 64), np.float32), cache, cache, np.zeros((2, 1), np.int32),
        np.zeros(2, np.int32), return_lse=True)
    assert not out.any() and np.all(lse == -np.inf)


def test_options_given_in_other_spellings_mean_the_same(kv):
    """float64 or list ALiBi slopes (as NumPy computes them) are float32 slopes; numpy's bools
    are bools; a window wider than int32 lengths, or a prefetch distance past int64,
    changes nothing rather than overflowing."""
    slopes = 2.0 ** -np.arange(1, 5)
    expected = decode(kv, alibi_slopes=slopes.astype(np.float32))
    np.testing.assert_array_equal(decode(kv, alibi_slopes=slopes), expected)
    np.testing.assert_array_equal(decode(kv, alibi_slopes=slopes.tolist()), expected)
    plain = decode(kv)
    for options in (dict(sliding_window=10**30), dict(prefetch=10**30), dict(prefetch=np.True_),
                    dict(prefetch=np.False_), dict(return_lse=np.False_)):
        np.testing.assert_array_equal(decode(kv, **options), plain, err_msg=str(options))
    plan = attention.plan_decode(kv.seq_lens, page_size=16, sliding_window=10**30)
    np.testing.assert_array_equal(decode(kv, sliding_window=2**40, plan=plan), plain)


@pytest.mark.parametrize("options, message", [
    (dict(seq_lens=[5, -2], page_size=16), "expected seq_lens >= 0, got -2 for sequence 1"),
    (dict(page_size=0), "expected page_size a positive integer, got 0"),
    (dict(page_size=16, num_threads=0), "expected num_threads an integer >= 1, got 0"),
    (dict(page_size=16, num_threads=1.5), "expected num_threads an integer >= 1, got 1.5"),
    (dict(page_size=16, num_threads=True), "expected num_threads an integer >= 1, got True"),
    (dict(page_size=16, sliding_window=-3), "expected sliding_window None or an integer >= 1"),
])
def test_plan_decode_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        attention.plan_decode(**{"seq_lens": [5, 9], **options})


# ------------------------------------------------------------------ every wrong argument
def _calls(rng):
    """Every wrapper with valid arguments (float32 caches of 6 pages, 2 KV heads, page 16)."""
    kv = PagedKV(rng, [40, 17], num_kv_heads=2, head_dim=64, page_size=16, kind="float32")
    table, lens = kv.block_table, kv.seq_lens
    options = dict(scale=None, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                   return_lse=False, out=None, prefetch=True, fast_bf16=True)
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    rows = rng.standard_normal((6, 4, 64), dtype=np.float32)
    new = rng.standard_normal((2, 2, 64), dtype=np.float32)
    free = sorted(set(range(kv.k.shape[0])) - set(table[table >= 0].tolist()))
    o, lse = rng.standard_normal((2, 3, 8), dtype=np.float32), np.zeros((2, 3), np.float32)
    return {
        "paged_decode_attention": dict(q=q, k_cache=kv.k, v_cache=kv.v, block_table=table,
                                       seq_lens=lens, plan=None, **options),
        "paged_prefill_attention": dict(q=rows, k_cache=kv.k, v_cache=kv.v, block_table=table,
                                        seq_lens=lens, qo_indptr=np.array([0, 4, 6], np.int32), **options),
        "write_kv": dict(k=new, v=new.copy(), k_cache=kv.k, v_cache=kv.v,
                         slot_mapping=np.array([free[0] * 16 + 3, -1], np.int64)),
        "copy_pages": dict(k_cache=kv.k, v_cache=kv.v, src=table[0, :1].copy(),
                           dst=np.array(free[:1], np.int32)),
        "gather_kv": dict(k_cache=kv.k, v_cache=kv.v, block_table=table, seq_lens=lens),
        "merge_states": dict(o_a=o, lse_a=lse, o_b=o.copy(), lse_b=lse.copy()),
    }


@pytest.mark.parametrize("op", sorted(_calls(np.random.default_rng(0))))
def test_any_wrong_argument_is_refused_cleanly_and_writes_nothing(op):
    """Each argument of the wrapper replaced by each wrong value, over 4 random caches (every
    case, 3,700 calls in all, in seconds): the call works or raises
    ValueError/TypeError/PagekvError saying "expected ..." — never another error from deeper
    down (Numba typing, numpy indexing, an attribute), never a crash of the process (q with no
    heads once reached the prefill kernel and segfaulted) — and a refused call writes no cache."""
    writer = op in ("write_kv", "copy_pages")
    wrong = []
    for seed in range(4):
        for name in sorted(_calls(np.random.default_rng(seed))[op]):
            value = _calls(np.random.default_rng(seed))[op][name]
            for label, _, mutate in [m for m in MUTATIONS + [READ_ONLY] * writer if m[1](value)]:
                args = _calls(np.random.default_rng(seed))[op]
                args[name] = mutate(args[name])
                caches = [args[c] for c in ("k_cache", "v_cache") if isinstance(args.get(c), np.ndarray)]
                problem = refusal_problem(lambda: getattr(attention, op)(**args),
                                          lambda: [c.tobytes() for c in caches])
                if problem:
                    wrong.append(f"seed {seed}, {name}={label}: {problem}")
    assert not wrong, "\n".join(wrong)
