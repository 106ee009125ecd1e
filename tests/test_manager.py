"""KVCacheManager: behaviour on real KV data, the design note's scenario, bad input, stats."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pagekv import (InvalidPageError, KVCache, KVCacheManager, KVCacheSpec, OutOfPagesError,
                    UnknownSequenceError, attention)
from pagekv import _arrays
from pagekv.errors import InvariantError
from pagekv.manager import DetachedSequence
from pagekv.prefix import ROOT_KEY, PrefixCache, chain_keys, salted_root
from pagekv.tables import csr_from_padded
from wrong_values import MUTATIONS, SEQ_ID_LISTS, refusal_problem


def snapshot(m):
    """Everything observable about a manager's state."""
    pages = np.arange(m.allocator.num_pages)
    prefix = None if m.prefix is None else (dict(m.prefix.page_of), list(m.prefix.evictable))
    return (m.block_table.tobytes(), m.seq_lens.tobytes(), m.allocator.free_pages().tolist(),
            m.allocator.refcount(pages).tolist(), prefix, sorted(m.seq_ids(), key=str), m.stats())


# ---------------------------------------------------------------------------------- real KV content
class Engine:
    """A manager backed by a real KVCache: each token's K and V hold its (sequence, position) tag."""

    def __init__(self, **options):
        self.m = KVCacheManager(**options)
        spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=self.m.page_size,
                           dtype="float32")
        self.cache = KVCache(spec, options["num_pages"])
        self.expected = {}  # seq_id -> list of per-token values

    def write(self, seq_id, slots, values):
        src, dst = self.m.take_pending_copies()
        if len(src):
            attention.copy_pages(self.cache.k(0), self.cache.v(0), src, dst)
        kv = np.array([[[v, -v]] for v in values], np.float32)
        attention.write_kv(kv, kv, self.cache.k(0), self.cache.v(0), slots)
        self.expected.setdefault(seq_id, []).extend(values)

    def add(self, seq_id, tokens):
        cached = self.m.add_sequence(seq_id, tokens)
        table = self.m.page_table(seq_id)
        positions = np.arange(cached, len(tokens))
        slots = table[positions // self.m.page_size] * self.m.page_size + positions % self.m.page_size
        self.expected[seq_id] = [float(t) for t in tokens[:cached]]
        self.write(seq_id, slots, [float(t) for t in tokens[cached:]])
        return cached

    def append(self, seq_id, tokens):
        self.write(seq_id, self.m.append(seq_id, tokens), [float(t) for t in tokens])

    def decode(self, seq_ids, tokens):
        slots = self.m.append_tokens(seq_ids, tokens)
        src, dst = self.m.take_pending_copies()
        if len(src):
            attention.copy_pages(self.cache.k(0), self.cache.v(0), src, dst)
        for seq_id, slot, token in zip(seq_ids, slots, tokens):
            kv = np.array([[[token, -token]]], np.float32)
            attention.write_kv(kv, kv, self.cache.k(0), self.cache.v(0), [slot])
            self.expected[seq_id].append(float(token))

    def fork(self, src, dst):
        self.m.fork(src, dst)
        self.expected[dst] = list(self.expected[src])

    def truncate(self, seq_id, num_tokens):
        self.m.truncate(seq_id, num_tokens)
        del self.expected[seq_id][num_tokens:]

    def verify(self):
        seq_ids = self.m.seq_ids()
        batch = self.m.batch(seq_ids)
        k, _, indptr = attention.gather_kv(self.cache.k(0), self.cache.v(0), batch.block_table,
                                           batch.seq_lens)
        for i, seq_id in enumerate(seq_ids):
            assert k[indptr[i]:indptr[i + 1], 0, 0].tolist() == self.expected[seq_id], seq_id
        self.m.check()


@pytest.mark.parametrize("caching", [True, False])
def test_every_sequence_reads_back_its_own_tokens(caching):
    e = Engine(num_pages=40, page_size=4, max_seqs=8, max_pages_per_seq=16, enable_prefix_caching=caching)
    system = list(range(100, 110))  # 10 tokens: 2 full pages + 2
    assert e.add("a", system + [1, 2, 3]) == 0
    hit = e.add("b", system + [7])
    assert hit == (8 if caching else 0)
    e.fork("a", "a2")                       # shares a's partial last page
    e.append("a", [4, 5])                  # copy-on-write of the shared partial page
    e.decode(["a2", "b"], [9, 8])          # a2 writes into its own (now unshared) page
    e.fork("b", "b2")
    e.decode(["b", "b2", "a"], [50, 51, 6])  # both sharers of b's partial page in one step
    e.append("b2", list(range(60, 75)))
    e.verify()
    e.m.free("a")
    e.add("c", system + [1, 2, 3, 4, 5, 6])  # a's pages, cached, are reused where they match
    e.verify()
    for seq_id in e.m.seq_ids():
        e.m.free(seq_id)
    e.m.clear_prefix_cache()
    assert e.m.allocator.num_free == 40
    e.m.check()


def test_design_note_scenario_paging_admits_what_contiguous_reservation_cannot():
    """Requests whose real lengths fit the pool but whose maximum lengths, reserved contiguously,
    do not: the design note's 128K / 512 / 64K requests, scaled down by 1024."""
    page_size = 16
    max_lengths = [128, 1, 64, 96, 32]      # tokens each may grow to, x1024 in the note
    real_lengths = [40, 1, 30, 20, 10]      # tokens each actually reaches
    num_pages = -(-sum(real_lengths) // page_size) + len(real_lengths)  # each may waste < 1 page
    pool_tokens = num_pages * page_size
    assert sum(max_lengths) > pool_tokens, "contiguous reservation of the maxima must not fit"
    m = KVCacheManager(num_pages=num_pages, page_size=page_size, max_seqs=8, max_pages_per_seq=16,
                       enable_prefix_caching=False)
    for i, n in enumerate(real_lengths):
        m.add_sequence(i, [i] * n)
    assert len(m) == len(real_lengths)
    m.check()


def test_out_of_pages_evicts_the_prefix_cache_first_then_refuses_without_change():
    m = KVCacheManager(num_pages=6, page_size=2, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", [1, 2, 3, 4, 5])   # 3 pages, 2 of them cached
    m.free("a")                            # the 2 cached pages stay, evictable; 1 page freed
    assert m.stats().pages_cached == 2 and m.stats().pages_free == 4
    m.add_sequence("b", [9] * 12)          # needs 6: evicts both cached pages
    assert m.stats().pages_cached == 0 and m.stats().pages_free == 0
    before = snapshot(m)
    with pytest.raises(OutOfPagesError) as info:
        m.add_sequence("c", [1])
    assert (info.value.requested, info.value.available) == (1, 0)
    with pytest.raises(OutOfPagesError):
        m.append("b", [1])
    with pytest.raises(OutOfPagesError):
        m.append_tokens(["b"], [1])
    assert snapshot(m) == before
    assert not m.can_add([1]) and not m.can_append("b")


def test_out_of_pages_with_a_partial_hit_changes_nothing():
    m = KVCacheManager(num_pages=5, page_size=2, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", [1, 2, 3, 4, 5])
    m.free("a")
    m.add_sequence("x", [7, 7])            # 1 page; free: 1, evictable: 2
    before = snapshot(m)
    with pytest.raises(OutOfPagesError) as info:  # hit on [1, 2] (kept): needs 4, can get 3
        m.add_sequence("b", [1, 2, 3] + [9] * 7)
    assert (info.value.requested, info.value.available) == (4, 3)
    assert snapshot(m) == before


def consecutive_share(tables):
    """Share of page-table steps that go to the physically next page."""
    steps = np.concatenate([np.diff(t) for t in tables if len(t) > 1])
    return float(np.mean(steps == 1))


@pytest.mark.parametrize("caching, at_least", [(False, 0.9), (True, 0.5)])
def test_tables_stay_in_physical_runs_under_churn(caching, at_least):
    """Sequences decode side by side, finish and are replaced by new prompts: each sequence grows
    onto the page after its last one, so its table stays in physical runs (attention then reads
    consecutive memory). The free list without runs kept 5% of these steps consecutive here (prefix
    caching off) and 0% (on). With caching on the pool runs full of cached pages and a new prompt
    lands wherever eviction frees pages, often right after a live sequence: fewer stay consecutive."""
    rng = np.random.default_rng(0)
    live, page_size = 8, 4
    m = KVCacheManager(num_pages=8 * 50 + 8, page_size=page_size, max_seqs=live, max_pages_per_seq=50,
                       enable_prefix_caching=caching)
    left, next_id = {}, 0

    def admit():
        nonlocal next_id
        m.add_sequence(next_id, rng.integers(0, 50, rng.integers(5, 61)))
        left[next_id] = int(rng.integers(10, 121))
        next_id += 1

    for _ in range(live):
        admit()
    for step in range(3000):
        seq_ids = list(left)
        m.append_tokens(seq_ids, rng.integers(0, 50, len(seq_ids)))
        for seq_id in seq_ids:
            left[seq_id] -= 1
            if left[seq_id] == 0:
                del left[seq_id]
                m.free(seq_id)
                admit()
    m.check()
    assert consecutive_share([m.page_table(s) for s in left]) >= at_least


def test_stats_by_hand():
    m = KVCacheManager(num_pages=20, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", list(range(10)))   # 3 pages (2 cached), 2 slots wasted
    m.fork("a", "b")                        # shares all 3
    stats = m.stats()
    assert stats.num_seqs == 2 and stats.num_tokens == 20
    assert stats.pages_used == 3 and stats.pages_free == 17 and stats.pages_cached == 0
    assert stats.fragmentation_tokens == 2 * 12 - 20
    assert stats.sharing_factor == 6 / 3
    m.add_sequence("c", list(range(9)))     # hits the 2 cached pages (8 tokens)
    stats = m.stats()
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens) == (8, 19)
    assert stats == m.stats() and hash(stats) == hash(m.stats())


def test_whole_prompt_cached_still_leaves_the_last_token_to_compute():
    m = KVCacheManager(num_pages=20, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", list(range(8)))
    assert m.add_sequence("b", list(range(8))) == 4


def test_batch_gives_csr_and_slot_mapping():
    m = KVCacheManager(num_pages=20, page_size=4, max_seqs=4, max_pages_per_seq=8,
                       enable_prefix_caching=False)
    m.add_sequence("a", list(range(9)))
    m.add_sequence("b", [1, 2])
    slots = m.append_tokens(["a", "b"], [5, 6])
    batch = m.batch(["b", "a"], csr=True, num_new_tokens=1)
    assert batch.seq_lens.tolist() == [3, 10]
    assert batch.kv_indptr.tolist() == [0, 1, 4]
    assert batch.kv_indices.tolist() == m.page_table("b").tolist() + m.page_table("a").tolist()
    assert batch.kv_last_page_len.tolist() == [3, 2]
    assert batch.slot_mapping.tolist() == [slots[1], slots[0]]


def test_slot_mapping_of_none_some_or_all_of_each_sequences_tokens():
    m = KVCacheManager(num_pages=40, page_size=4, max_seqs=4, max_pages_per_seq=8,
                       enable_prefix_caching=False)
    lens = {"a": 9, "b": 2, "c": 13}
    for seq_id, n in lens.items():
        m.add_sequence(seq_id, list(range(n)))
    for counts in ([0, 2, 13], [5, 1, 7]):
        expected = [int(m.page_table(s)[p // 4]) * 4 + p % 4
                    for s, n in zip(lens, counts) for p in range(lens[s] - n, lens[s])]
        assert m.batch(list(lens), num_new_tokens=np.array(counts)).slot_mapping.tolist() == expected


def test_csr_of_an_empty_sequence_has_no_pages_and_a_last_page_of_zero_tokens():
    indptr, indices, last = csr_from_padded(np.array([[4, 2], [9, 9], [7, 0]]), np.array([5, 0, 4]), 4)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 2, 3], [4, 2, 7], [1, 0, 4])


def test_prefix_keys_are_stable_across_processes():
    tokens = np.arange(64, dtype=np.int32)
    code = ("import numpy as np; from pagekv.prefix import chain_keys; "
            "print(chain_keys(np.arange(64, dtype=np.int32), 16)[-1].hex())")
    outputs = {subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout.strip()
               for seed in ("1", "2")}
    assert outputs == {chain_keys(tokens, 16)[-1].hex()}


# ---------------------------------------------------------------------------------- bad input
def _busy_manager():
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=3, max_pages_per_seq=4)
    m.add_sequence("a", list(range(6)))
    m.fork("a", "b")
    return m


@pytest.fixture
def busy():
    return _busy_manager()


@pytest.mark.parametrize("call, error, message", [
    (lambda m: m.append("zz", [1]), UnknownSequenceError, "expected a held sequence id, got 'zz'"),
    (lambda m: m.free("zz"), UnknownSequenceError, "got 'zz'"),
    (lambda m: m.fork("zz", "q"), UnknownSequenceError, "got 'zz'"),
    (lambda m: m.seq_len(["unhashable"]), UnknownSequenceError, "expected a held sequence id"),
    (lambda m: m.add_sequence("a", [1]), ValueError, "expected a new seq_id, got 'a'"),
    (lambda m: m.fork("a", "b"), ValueError, "expected a new dst_id, got 'b'"),
    (lambda m: m.add_sequence("c", []), ValueError, "expected at least one token id"),
    (lambda m: m.add_sequence("c", [1, -2]), ValueError, r"expected token ids in \[0, 2\*\*31 - 1\], got -2"),
    (lambda m: m.add_sequence("c", [2**31]), ValueError, "got 2147483648"),
    (lambda m: m.add_sequence("c", [1.5]), TypeError, "expected integer token ids, got dtype float64"),
    (lambda m: m.add_sequence("c", [[1, 2]]), ValueError, "expected a 1-D sequence of token ids"),
    (lambda m: m.add_sequence("c", list(range(17))), ValueError, "expected at most 16 tokens .* got 17"),
    (lambda m: m.append("a", list(range(11))), ValueError, "expected at most 16 tokens .* got 17"),
    (lambda m: m.append_tokens(["a", "a"], [1, 2]), ValueError, "distinct seq_ids"),
    (lambda m: m.truncate("a", 0), ValueError,
     r"expected num_tokens an integer in \[1, 6\] \(the tokens of 'a' to keep\), got 0"),
    (lambda m: m.truncate("a", 7), ValueError, r"in \[1, 6\] .* got 7"),
    (lambda m: m.truncate("a", 2.0), ValueError, "got 2.0"),
    (lambda m: m.truncate("a", True), ValueError, "got True"),
    (lambda m: m.truncate("zz", 1), UnknownSequenceError, "got 'zz'"),
    (lambda m: m.attach("c", DetachedSequence(3, np.empty(0, np.int32))), ValueError,
     r"expected a record holding its 3 token ids \(detach\(\) of a manager that caches prefixes\), got 0"),
    (lambda m: m.attach("c", (3, [1, 2, 3])), TypeError, "expected a DetachedSequence from detach"),
    (lambda m: m.append_tokens(["a", "b"], [1]), ValueError, r"one token per sequence \(2\), got 1"),
    (lambda m: m.append_tokens(["a", "zz"], [1, 2]), UnknownSequenceError, "got 'zz'"),
    (lambda m: m.batch(["a"], num_new_tokens=7), ValueError,
     r"expected num_new_tokens an int or one per sequence \(1\), each in \[0, seq_len\], got 7"),
    (lambda m: m.batch(["a"], num_new_tokens=10**30), ValueError, "each in .* got 10000"),
    (lambda m: m.batch(["a"], num_new_tokens=[1, 1]), ValueError, r"got \[1, 1\] for lengths \[6\]"),
    (lambda m: m.batch(["a"], num_new_tokens=1.0), ValueError, "got 1.0"),
    (lambda m: m.batch(["a"], num_new_tokens=True), ValueError, "got True"),
    (lambda m: m.batch(["a", "a"], num_new_tokens=1), ValueError, "expected distinct seq_ids, got a repeated id"),
    (lambda m: m.batch(None), TypeError, "expected seq_ids a list of sequence ids, got None"),
    (lambda m: m.batch("ab"), TypeError, "expected seq_ids a list of sequence ids, got 'ab'"),
    (lambda m: m.batch(["a"], csr=np.array([1, 2])), ValueError, r"expected csr a bool, got array\(\[1, 2\]\)"),
    (lambda m: m.append_tokens(7, [1]), TypeError, "expected seq_ids a list of sequence ids, got 7"),
    (lambda m: m.append_tokens(np.array(3), [1]), TypeError, "got array\\(3\\)"),
    (lambda m: m.can_append("a", 0), ValueError, "expected num_tokens an integer >= 1, got 0"),
    (lambda m: m.can_append("a", -1), ValueError, "got -1"),
    (lambda m: m.can_append("a", 2.5), ValueError, "got 2.5"),
    (lambda m: m.add_sequence(["c"], [1]), TypeError, r"expected a hashable seq_id, got list \['c'\]"),
    (lambda m: m.fork("a", {"c": 1}), TypeError, "expected a hashable dst_id, got dict"),
    (lambda m: m.pages_obtainable(keep=3), TypeError, "expected keep an iterable of page ids, got 3"),
    (lambda m: m.add_sequence("c", [1], cache_salt=7), TypeError, "expected cache_salt None, bytes or str, got int 7"),
    (lambda m: m.can_add([1], cache_salt=bytearray(b"a")), TypeError, "got bytearray"),
    (lambda m: m.attach("c", DetachedSequence(1, np.array([1], np.int32), 5)), TypeError, "got int 5"),
    (lambda m: m.restore_cached([b"k" * 16], keep=None), TypeError, "expected keep an iterable of page ids"),
    (lambda m: m.restore_cached([b"k" * 16, 7]), TypeError, "expected keys a list of bytes prefix keys"),
    (lambda m: m.restore_cached(None), TypeError, "expected keys a list of bytes prefix keys, got None"),
])
def test_bad_input_raises_and_changes_nothing(busy, call, error, message):
    before = snapshot(busy)
    with pytest.raises(error, match=message):
        call(busy)
    assert snapshot(busy) == before


def _manager_calls():
    """Every public manager call with valid arguments, against the ``busy`` manager (sequences
    "a" and its fork "b" of 6 tokens, page 4, 16 pages, 3 rows)."""
    tokens = np.array([1, 2, 3], np.int32)
    return {
        "seq_len": dict(seq_id="a"), "page_table": dict(seq_id="a"), "can_add": dict(token_ids=tokens, cache_salt=b"s"),
        "can_append": dict(seq_id="a", num_tokens=1), "pages_obtainable": dict(keep=[0]),
        "batch": dict(seq_ids=["a", "b"], csr=True, num_new_tokens=np.array([1, 2])),
        "add_sequence": dict(seq_id="c", token_ids=tokens, cache_salt="s"), "append": dict(seq_id="a", token_ids=tokens),
        "append_tokens": dict(seq_ids=["a", "b"], token_ids=np.array([7, 8], np.int32)),
        "fork": dict(src_id="a", dst_id="c"), "free": dict(seq_id="a"), "detach": dict(seq_id="a"),
        "truncate": dict(seq_id="a", num_tokens=5), "discard": dict(seq_id="a", num_written=3),
        "attach": dict(seq_id="c", record=DetachedSequence(3, tokens), reuse_cached=True),
        "attach_shared": dict(seq_ids=["c"], records=[DetachedSequence(3, tokens)],
                              page_indices=[np.array([0])], reuse_cached=False),
        "restore_cached": dict(keys=[b"k" * 16], keep=[0]),
    }


@pytest.mark.parametrize("method", sorted(_manager_calls()))
def test_every_wrong_argument_is_refused_cleanly_and_changes_nothing(method):
    """Each argument of the call replaced by each wrong value (tests/wrong_values.py, and lists
    of ids): it works, or raises ValueError/TypeError/PagekvError saying "expected ..." with the
    manager exactly as it was — never an error from deeper down (numpy, iteration, len)."""
    wrong = []
    for name, value in _manager_calls()[method].items():
        cases = [(label, mutate(value)) for label, applies, mutate in MUTATIONS if applies(value)]
        for label, bad in cases + SEQ_ID_LISTS * isinstance(value, list):
            m = _busy_manager()
            args = {**_manager_calls()[method], name: bad}
            problem = refusal_problem(lambda: getattr(m, method)(**args), lambda: snapshot(m))
            if problem:
                wrong.append(f"{name}={label}: {problem}")
            m.check()
    assert not wrong, "\n".join(wrong)


def test_too_many_sequences(busy):
    busy.add_sequence("c", [1])
    before = snapshot(busy)
    with pytest.raises(ValueError, match="expected at most max_seqs=3 sequences"):
        busy.add_sequence("d", [1])
    with pytest.raises(ValueError, match="max_seqs"):
        busy.fork("a", "d")
    record = DetachedSequence(2, np.array([1, 2], np.int32))
    assert busy.attach_shared([], [], []).tolist() == []  # nothing to attach: no row needed
    with pytest.raises(ValueError, match="expected at most max_seqs=3 sequences, got 1 more"):
        busy.attach("d", record)
    with pytest.raises(ValueError, match="got 2 more"):
        busy.attach_shared(["d", "e"], [record, record], [[0], [0]])
    assert snapshot(busy) == before


def test_append_tokens_past_max_pages_changes_nothing():
    m = KVCacheManager(num_pages=16, page_size=2, max_seqs=2, max_pages_per_seq=2)
    m.add_sequence("a", [1, 2, 3, 4])
    m.add_sequence("b", [1])
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_pages_per_seq=2 pages, got 'a' needing page 3"):
        m.append_tokens(["b", "a"], [5, 6])
    assert snapshot(m) == before


@pytest.mark.parametrize("options, message", [
    (dict(num_pages=0), "num_pages"), (dict(page_size=1.5), "page_size"),
    (dict(max_seqs=True), "max_seqs"), (dict(num_pages=2**30, page_size=4), "below 2\\*\\*31"),
    (dict(enable_prefix_caching="no"), "expected enable_prefix_caching a bool, got 'no'"),
])
def test_bad_construction(options, message):
    with pytest.raises(ValueError, match=message):
        KVCacheManager(**{**dict(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=4), **options})


# ---------------------------------------------------------------------------------- spec and storage
def test_spec_bytes_and_budget():
    spec = KVCacheSpec(num_layers=80, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
    assert spec.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680
    assert spec.bytes_per_page == 16 * 327680
    assert spec.pages_for_budget(spec.bytes_per_page * 3 + 5) == 3
    # the design note's 128K context on a 70B model (80 layers, 8 KV heads): linear, 40 GiB
    assert 131072 * spec.bytes_per_token == 40 * 2**30
    with pytest.raises(ValueError, match="expected dtype one of"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="int8")
    with pytest.raises(ValueError, match="expected head_dim a positive integer"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=0)
    assert spec.pages_for_budget(0) == 0 and spec.pages_for_budget(spec.bytes_per_page - 1) == 0
    for dtype, itemsize in (("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1)):
        small = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=80, page_size=5, dtype=dtype)
        assert small.itemsize == itemsize and small.bytes_per_token == 2 * 3 * 2 * 80 * itemsize
    # frozen: equal by value, a dict key, and not changed behind a cache's back
    assert {spec: 1}[KVCacheSpec(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16")] == 1
    with pytest.raises(AttributeError):
        spec.page_size = 32


def test_kv_cache_views_and_size():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
    cache = KVCache(spec, 5)
    assert cache.k(2).shape == (5, 2, 4, 8) and cache.k(2).flags.c_contiguous
    assert cache.nbytes == 5 * spec.bytes_per_page
    cache.v(1)[3] = 7
    assert cache.data[1, 1, 3].min() == 7 and cache.k(1).max() == 0
    for layer in (3, -1, 1.0, True, "0"):
        with pytest.raises(IndexError, match=rf"expected layer in \[0, 3\), got {layer!r}"):
            cache.v(layer)
    assert cache.k(np.int64(2)).shape == (5, 2, 4, 8)


@pytest.mark.parametrize("dtype, num_pages", [("float32", 1), ("bfloat16", 97), ("float16", 4096),
                                              ("float8_e4m3fn", 33)])
def test_kv_cache_starts_on_a_cache_line_past_a_4k_boundary(dtype, num_pages):
    # small caches come from the heap and large ones from mmap: both start where _arrays says
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=80, page_size=16, dtype=dtype)
    cache = KVCache(spec, num_pages)
    assert cache.data.ctypes.data % 4096 == _arrays.START_PAST_4K
    assert _arrays.START_PAST_4K % 64 == 0 and cache.data.shape[2] == num_pages
    assert not cache.data.any() and cache.data.flags.c_contiguous and cache.data.flags.writeable


def test_kv_cache_too_big_fails_before_touching_memory():
    spec = KVCacheSpec(num_layers=80, num_kv_heads=8, head_dim=128, dtype="float32")
    with pytest.raises(MemoryError, match=r"expected a KV cache within the \d+\.\d GiB available, "
                                          r"got 10000000 pages x 10485760 B = 97656\.2 GiB$") as refused:
        KVCache(spec, 10**7)  # 100 TB
    with open("/proc/meminfo") as f:  # the figure it names is the OS's MemAvailable (kB)
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    named = float(str(refused.value).split("within the ")[1].split(" GiB")[0])
    assert named == pytest.approx(kib / 2**20, rel=0.1, abs=0.2)


@pytest.mark.parametrize("call, error, message", [
    (lambda: KVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8), 0), ValueError,
     "expected num_pages a positive integer, got 0"),
    (lambda: KVCache("spec", 4), TypeError, "expected a KVCacheSpec, got str"),
    (lambda: KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8).pages_for_budget(-1), ValueError,
     "expected a budget >= 0 bytes, got -1"),
    (lambda: KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=True), ValueError,
     "expected page_size a positive integer"),
])
def test_spec_and_cache_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_kv_cache_over_caller_storage_is_zero_copy():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
    owned = np.zeros((2, 2, 3, 1, 4, 8), np.float32)
    cache = KVCache(spec, 3, storage=owned)
    attention.write_kv(np.ones((1, 1, 8), np.float32), np.full((1, 1, 8), 2, np.float32),
                       cache.k(1), cache.v(1), [5])
    assert owned[1, 0, 1, 0, 1].tolist() == [1.0] * 8 and owned[1, 1, 1, 0, 1].tolist() == [2.0] * 8
    half = KVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16"),
                   2, storage=np.zeros((1, 2, 2, 1, 4, 8), np.float16))
    assert half.k(0).dtype == np.float16


@pytest.mark.parametrize("storage, error, message", [
    (np.zeros((2, 2, 3, 1, 4, 8), np.float16), TypeError, "expected storage of dtype float32 .* got float16"),
    (np.zeros((2, 2, 4, 1, 4, 8), np.float32), ValueError, r"expected storage of shape \(2, 2, 3, 1, 4, 8\)"),
    (np.zeros((2, 2, 3, 1, 4, 16), np.float32)[..., ::2], ValueError, "C-contiguous, writeable"),
])
def test_kv_cache_refuses_mismatched_storage(storage, error, message):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
    with pytest.raises(error, match=message):
        KVCache(spec, 3, storage=storage)


def test_batch_repeats_an_id_for_reading_only(busy):
    """Attention may read one sequence twice (its rows repeat); only slots to write must be distinct."""
    batch = busy.batch(["a", "b", "a"])
    np.testing.assert_array_equal(batch.block_table[0], batch.block_table[2])
    np.testing.assert_array_equal(batch.seq_lens, [6, 6, 6])


# ------------------------------------------------------------------- limits met exactly (mutation-found)
def test_construction_at_the_int32_slot_limit():
    """The last slot may be 2**31 - 1 exactly, not one more."""
    m = KVCacheManager(num_pages=2**15, page_size=2**16, max_seqs=1, max_pages_per_seq=1)
    assert m.allocator.num_pages * m.page_size - 1 == 2**31 - 1
    with pytest.raises(ValueError, match="expected num_pages \\* page_size below 2\\*\\*31"):
        KVCacheManager(num_pages=2**15 + 1, page_size=2**16, max_seqs=1, max_pages_per_seq=1)


def test_token_ids_up_to_int32_max_are_taken_and_the_refusal_names_the_offender():
    m = KVCacheManager(num_pages=4, page_size=2, max_seqs=2, max_pages_per_seq=2)
    m.add_sequence("a", [0, 2**31 - 1])
    before = snapshot(m)
    with pytest.raises(ValueError, match="got 2147483648"):
        m.add_sequence("b", [0, 2**31])
    with pytest.raises(ValueError, match="got -1"):
        m.append("a", [-1, 2**31])
    assert snapshot(m) == before


@pytest.mark.parametrize("caching", [True, False])
def test_can_add_and_can_append_at_the_exact_limits(caching):
    m = KVCacheManager(num_pages=5, page_size=2, max_seqs=2, max_pages_per_seq=3,
                       enable_prefix_caching=caching)
    assert m.can_add([1] * 6)            # max_pages_per_seq pages exactly
    assert not m.can_add([1] * 7)        # one page more, with rows and pages to spare
    m.add_sequence("a", [1, 2, 3])       # 2 pages: 3 free
    assert m.can_append("a", 3)          # fills page 2 and needs exactly max_pages_per_seq
    assert not m.can_append("a", 4)
    m.add_sequence("b", [9])             # 1 page: 2 free
    assert m.can_append("b", 5)          # 2 more pages: exactly what is free
    assert not m.can_append("b", 6)
    m.free("b")
    assert m.can_add([7] * 6)            # 3 pages, exactly the free ones
    m.add_sequence("c", [5, 6])          # 1 page: 2 free, no row left
    assert not m.can_add([8])


def test_a_growing_sequence_takes_the_page_after_its_last():
    """append and append_tokens grow a one-page sequence onto the physical page after it, where a
    request with no such hint starts far away (the allocator's runs)."""
    m = KVCacheManager(num_pages=64, page_size=2, max_seqs=4, max_pages_per_seq=8,
                       enable_prefix_caching=False)
    m.add_sequence("a", [1, 2])
    m.add_sequence("b", [3, 4])
    a0, b0 = int(m.page_table("a")[0]), int(m.page_table("b")[0])
    assert abs(a0 - b0) > 1
    m.append("a", [5])
    m.append_tokens(["b"], [6])
    assert m.page_table("a").tolist() == [a0, a0 + 1]
    assert m.page_table("b").tolist() == [b0, b0 + 1]


def test_every_sharer_of_a_partial_page_appending_at_once_leaves_the_page_to_one():
    """Three tables share a partly filled last page (refcount 3): one batch appending to all three
    copies it twice, and the last holder keeps the original, which stays allocated."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=4,
                       enable_prefix_caching=False)
    m.add_sequence("a", [1, 2, 3])
    m.fork("a", "b")
    m.fork("a", "c")
    page = int(m.page_table("a")[0])
    m.append_tokens(["a", "b", "c"], [4, 5, 6])
    src, dst = m.take_pending_copies()
    assert src.tolist() == [page, page] and len(set(dst.tolist())) == 2
    pages = sorted(int(m.page_table(s)[0]) for s in "abc")
    assert page in pages and sorted(dst.tolist() + [page]) == pages
    assert m.allocator.refcount([page]).tolist() == [1]
    m.check()


def test_a_sharers_copy_takes_the_page_after_the_page_before_it():
    """Copy-on-write places the copy of a shared last page after the sharer's page before it, so
    the copying sequence regains a run where it can."""
    m = KVCacheManager(num_pages=64, page_size=2, max_seqs=4, max_pages_per_seq=8,
                       enable_prefix_caching=False)
    m.add_sequence("a", [1, 2])
    first = int(m.page_table("a")[0])
    blocker = m.allocator.allocate(1, after=first)  # someone else holds the page after a's
    assert blocker.tolist() == [first + 1]
    m.append("a", [3])                              # so a grows elsewhere
    assert int(m.page_table("a")[1]) != first + 1
    m.fork("a", "b")
    m.allocator.decref(blocker)                     # the page after a's first is free again
    m.append_tokens(["b"], [4])                     # b's shared last page is copied there
    assert m.page_table("b").tolist() == [first, first + 1]
    m.check()


# ---------------------------------------------------------------------------------- truncate
@pytest.mark.parametrize("caching", [True, False])
def test_speculative_drafts_rolled_back_leave_every_sequence_reading_its_own_tokens(caching):
    """Drafts appended, then the rejected ones dropped with truncate, on shared and cached pages:
    each sequence reads back exactly the tokens it kept and those appended after."""
    e = Engine(num_pages=40, page_size=4, max_seqs=8, max_pages_per_seq=16, enable_prefix_caching=caching)
    system = list(range(100, 110))           # 2 full pages + 2
    e.add("a", system + [1])
    e.fork("a", "b")                         # shares every page, the partial third too
    e.append("a", [2, 3, 4, 5, 6])           # drafts across a page boundary (copy of the shared page)
    e.truncate("a", 13)                      # 2 of them accepted: back inside the third page
    e.append("a", [7, 8])
    e.truncate("b", 6)                       # into b's second page, full and shared with a
    e.decode(["a", "b"], [9, 10])            # b writes to a copy, never into a's page
    e.truncate("a", 8)                       # exactly two full pages: the next token starts a page
    e.decode(["a", "b"], [11, 12])
    e.verify()
    assert [e.m.seq_len(s) for s in "ab"] == [9, 8]
    if caching:  # every full page is cached under the keys of the tokens it holds now
        for values in e.expected.values():
            assert set(chain_keys([int(v) for v in values], 4)) <= e.m.prefix.page_of.keys()
    for seq_id in e.m.seq_ids():
        e.m.free(seq_id)
    e.m.clear_prefix_cache()
    assert e.m.allocator.num_free == 40


def test_truncate_into_a_cached_page_copies_it_on_the_next_write_and_leaves_it_evictable():
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", [1, 2, 3, 4, 5, 6])          # page 0 full and cached, page 1 partial
    m.truncate("a", 2)
    assert m.page_table("a").tolist() == [0] and m.allocator.num_free == 15
    assert m.allocator.refcount([0]).tolist() == [2]  # a's table and the cache
    assert m.append("a", [9]).tolist() == [1 * 4 + 2]  # onto a copy, on the page after it
    src, dst = m.take_pending_copies()
    assert (src.tolist(), dst.tolist()) == ([0], [1])
    assert list(m.prefix.evictable) == [0]            # the cache's alone now
    m.check()
    assert m.add_sequence("b", [1, 2, 3, 4, 7]) == 4  # and still a hit for its prefix
    assert m.page_table("b")[0] == 0


def test_pages_filled_after_a_rollback_are_cached_under_their_own_tokens():
    """A page rolled back and refilled with other tokens is cached under the keys of what it holds,
    also for a sequence detached and attached in between; the rolled-back tokens' keys are not."""
    m = KVCacheManager(num_pages=32, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", [1, 2, 3, 4, 5, 6])
    m.append("a", [7, 8, 9])                          # fills page 1 with 5 6 7 8
    m.truncate("a", 5)
    record = m.detach("a")
    m.attach("a", record)
    m.append("a", [60, 70, 80, 90])                   # page 1 now holds 5 60 70 80
    tokens = [1, 2, 3, 4, 5, 60, 70, 80, 90]
    assert set(chain_keys(tokens, 4)) <= m.prefix.page_of.keys()
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] in m.prefix.page_of  # cached when it was full
    m.free("a")
    assert m.add_sequence("b", tokens) == 8
    m.check()


def test_truncate_releases_pages_last_first_and_to_the_full_length_changes_nothing():
    m = KVCacheManager(num_pages=16, page_size=2, max_seqs=2, max_pages_per_seq=8)
    m.add_sequence("a", [1, 2, 3, 4, 5, 6, 7])
    before = snapshot(m)
    m.truncate("a", 7)
    assert snapshot(m) == before
    m.truncate("a", 3)
    assert m.page_table("a").tolist() == [0, 1] and m.seq_len("a") == 3
    assert list(m.prefix.evictable) == [2]            # page 2 (tokens 5 6) is full and cached
    assert m.allocator.is_free([3]).tolist() == [True] and m.allocator.num_free == 13
    m.check()


def test_a_queued_copy_into_a_page_released_before_it_runs_is_dropped():
    """The copy of a shared page is moot once its destination returns to the pool (the page may be
    handed out, and written, before the caller runs the copies); a copy into a held page stays."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8,
                       enable_prefix_caching=False)
    m.add_sequence("a", [1, 2, 3, 4, 5])
    m.fork("a", "b")
    m.fork("a", "c")
    m.append("a", [6])                # a copies the shared page 1 ...
    m.truncate("a", 4)                # ... and gives its copy back
    m.append("b", [7])                # b copies it too ...
    m.free("b")                       # ... and is freed
    m.append("c", [8])                # c is its last holder now: no copy
    assert [x.tolist() for x in m.take_pending_copies()] == [[], []]
    m.fork("c", "d")
    m.append("d", [9])                # d copies c's page 1 and keeps the copy:
    m.truncate("d", 6)                # truncate releases nothing here
    src, dst = m.take_pending_copies()
    assert src.tolist() == [int(m.page_table("c")[1])] and dst.tolist() == [int(m.page_table("d")[1])]
    m.check()


def test_a_queued_copy_holds_its_source_so_a_tier_write_cannot_overwrite_it_first():
    """The last table holding a copy's source lets go before the copies run: the source stays out of
    the pool until take_pending_copies, so a sequence a tier brings back (its KV written at once)
    cannot land on it and the copy still reads what the source held."""
    e = Engine(num_pages=4, page_size=4, max_seqs=4, max_pages_per_seq=4, enable_prefix_caching=False)
    e.add("a", [1, 2])
    e.fork("a", "b")
    slots = e.m.append("b", [3])                 # b's copy of the shared page is queued
    src = int(e.m.page_table("a")[0])
    e.m.free("a")
    del e.expected["a"]
    assert e.m.allocator.refcount([src]).tolist() == [1] and e.m.stats().pages_free == 2
    e.m.check()
    with pytest.raises(OutOfPagesError):         # 3 pages would need the source
        e.m.attach("x", DetachedSequence(9, np.empty(0, np.int32)))
    restored = e.m.attach("x", DetachedSequence(8, np.empty(0, np.int32)))
    assert src not in restored.tolist()
    kv = np.array([[[v, -v]] for v in range(20, 28)], np.float32)
    attention.write_kv(kv, kv, e.cache.k(0), e.cache.v(0), e.m.batch(["x"], num_new_tokens=8).slot_mapping)
    e.expected["x"] = list(range(20, 28))
    e.write("b", slots, [3.0])                   # the copies run, then b's token is written
    assert e.m.allocator.is_free([src]).tolist() == [True]  # let go when taken
    e.verify()


def test_the_last_table_holding_a_queued_copys_source_writes_into_it_without_a_copy():
    """A reference held for a queued copy does not make its source shared: the copy reads the page
    before anyone writes, so its last table holder appends in place."""
    e = Engine(num_pages=8, page_size=8, max_seqs=4, max_pages_per_seq=4, enable_prefix_caching=False)
    e.add("a", [1, 2])
    e.fork("a", "b")
    page = int(e.m.page_table("a")[0])
    slots = e.m.append_tokens(["b", "a"], [3, 4])   # b copies the page; a keeps it
    assert int(e.m.page_table("a")[0]) == page and slots[1] == page * 8 + 2
    slots = np.append(slots, e.m.append_tokens(["a"], [5]))
    slots = np.append(slots, e.m.append("a", [6]))
    assert slots[1:].tolist() == [page * 8 + 2, page * 8 + 3, page * 8 + 4]
    src, dst = e.m.take_pending_copies()
    assert src.tolist() == [page] and dst.tolist() == [int(e.m.page_table("b")[0])]
    attention.copy_pages(e.cache.k(0), e.cache.v(0), src, dst)
    e.write("b", slots[:1], [3.0])
    e.write("a", slots[1:], [4.0, 5.0, 6.0])
    e.verify()


def test_a_copy_from_a_page_that_waits_for_its_own_copy_reads_that_copys_source():
    """Queued copies run in parallel, so no page is both a source and a destination: b's page,
    itself a copy still queued, is copied for c (forked before b's slots were written) from
    the page b's copy reads."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=4,
                       enable_prefix_caching=False)
    m.add_sequence("a", [1, 2])
    m.fork("a", "b")
    m.append("b", [3])
    m.fork("b", "c")
    m.append("c", [4])
    m.check()
    page = int(m.page_table("a")[0])
    assert m.allocator.refcount([page]).tolist() == [3]  # a's table and two queued copies
    src, dst = m.take_pending_copies()
    assert src.tolist() == [page, page]
    assert dst.tolist() == [int(m.page_table("b")[0]), int(m.page_table("c")[0])]
    assert m.allocator.refcount([page]).tolist() == [1]
    m.check()


def test_a_queued_copy_into_a_cached_page_is_dropped_when_the_cache_lets_it_go():
    """A copy's destination filled and cached, its sequence freed before the copies run: the page is
    the cache's alone, and evicting or clearing it drops the copy and lets go of its source."""
    for let_go in (lambda m: m.clear_prefix_cache(),
                   lambda m: m.add_sequence("big", list(range(40, 53)))):  # 4 pages: evicts it
        m = KVCacheManager(num_pages=5, page_size=4, max_seqs=4, max_pages_per_seq=4)
        m.add_sequence("a", [1, 2])
        m.fork("a", "b")
        m.append("b", [3, 4])                    # a copy of a's page, full and cached
        m.free("b")
        assert len(m.prefix.evictable) == 1
        m.check()
        let_go(m)
        assert [x.tolist() for x in m.take_pending_copies()] == [[], []]
        assert m.allocator.refcount(m.page_table("a")).tolist() == [1]
        m.check()


def test_attach_reusing_cached_pages_takes_them_back_and_leaves_only_the_rest_to_copy():
    """A detached sequence's full pages stay cached; attached with reuse_cached they come back
    from the cache holding their KV, and only the partial page is fresh (what a tier copies)."""
    e = Engine(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    e.add("a", list(range(10)))                 # 2 full pages (cached) + 1 partial
    table = e.m.page_table("a").tolist()
    record = e.m.detach("a")
    assert e.m.stats().pages_cached == 2
    pages, fresh = e.m.attach("a", record, reuse_cached=True)
    assert pages[:2].tolist() == table[:2] and fresh.tolist() == [False, False, True]
    assert e.m.allocator.refcount(pages[:2]).tolist() == [2, 2] and e.m.stats().pages_cached == 0
    kv = np.array([[[v, -v]] for v in (8, 9)], np.float32)   # the tier's copy of the partial page
    attention.write_kv(kv, kv, e.cache.k(0), e.cache.v(0), pages[2] * 4 + np.arange(2))
    e.expected["a"] = [float(t) for t in range(10)]
    e.decode(["a"], [10])
    e.verify()
    record = e.m.detach("a")
    plain = e.m.attach("a", record)             # without reuse: every page fresh, as before
    assert isinstance(plain, np.ndarray) and not set(plain.tolist()) & set(table[:2])
    e.m.check()


def test_attach_shared_reuses_a_page_full_for_one_sequence_and_partial_for_another():
    """Forks detached together: b was truncated into a's second page (full and cached). Both
    take it back from the cache, and b's next token copies it first, a cached page being shared."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", list(range(9)))
    m.take_pending_copies()                     # a step: its forward writes a's KV
    m.fork("a", "b")
    m.truncate("b", 6)
    cached = m.page_table("a")[:2].tolist()
    records = [m.detach("a"), m.detach("b")]
    pages, fresh = m.attach_shared(["a", "b"], records, [[0, 1, 2], [0, 1]], reuse_cached=True)
    assert pages[:2].tolist() == cached and fresh.tolist() == [False, False, True]
    assert m.allocator.refcount(pages).tolist() == [3, 3, 1]
    m.append("b", [60])
    src, dst = m.take_pending_copies()
    assert src.tolist() == [cached[1]] and dst.tolist() == [m.page_table("b")[1]]
    m.check()


def test_attach_reusing_never_evicts_the_pages_it_reuses():
    """Short of a fresh page, attach evicts other cached pages, not the ones it takes back; with
    none to evict it refuses and changes nothing."""
    m = KVCacheManager(num_pages=4, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", list(range(9)))         # 2 full pages + 1 partial
    m.take_pending_copies()                     # a step: its forward writes a's KV
    record = m.detach("a")
    m.add_sequence("x", list(range(100, 108)))  # the 2 free pages, full (cached)
    before = snapshot(m)
    with pytest.raises(OutOfPagesError):       # the partial page: only a's own pages are evictable
        m.attach("a", record, reuse_cached=True)
    assert snapshot(m) == before
    x_pages = m.page_table("x").tolist()
    m.free("x")
    pages, fresh = m.attach("a", record, reuse_cached=True)
    assert fresh.tolist() == [False, False, True] and pages[2] in x_pages
    assert len(m.prefix.evictable) == 1         # x's other page
    m.check()


def test_attach_leaves_alone_a_cached_page_whose_kv_the_coming_forward_writes():
    """A full page enters the prefix cache when handed out; its KV comes with the step's forward.
    An attach before that forward copies the page fresh instead of sharing it: if the forward
    fails, discard takes the page's tokens back and nothing ever writes it. Once the step has
    begun (take_pending_copies), later attaches share it."""
    e = Engine(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    e.add("a", [0, 1, 2, 3, 0])
    record = e.m.detach("a")
    e.m.clear_prefix_cache()
    e.m.add_sequence("b", [0, 1, 2, 3, 0])       # the same first page, handed out and cached again
    b_page = int(e.m.page_table("b")[0])
    pages, fresh = e.m.attach("a", record, reuse_cached=True)
    assert fresh.tolist() == [True, True] and b_page not in pages.tolist()
    kv = np.array([[[v, -v]] for v in (0, 1, 2, 3, 0)], np.float32)  # the tier's copy
    attention.write_kv(kv, kv, e.cache.k(0), e.cache.v(0), e.m.batch(["a"], num_new_tokens=5).slot_mapping)
    e.m.discard("b", 0)                         # b's forward failed: its page holds nothing
    e.verify()                                  # a reads its own KV
    e.add("b", [0, 1, 2, 3, 0])                 # a step runs b's forward
    e.m.check()
    record = e.m.detach("a")
    pages, fresh = e.m.attach("a", record, reuse_cached=True)
    assert fresh.tolist() == [False, True] and pages[0] == e.m.page_table("b")[0]


def test_a_cache_salt_shares_pages_only_within_its_salt():
    """Equal token ids under other salts (other KV: an adapter, images) never share a page; the
    salt follows a sequence into its forks, its detached record and the pages it fills later."""
    m = KVCacheManager(num_pages=32, page_size=4, max_seqs=8, max_pages_per_seq=8)
    prompt = list(range(9))                                          # 2 full pages + 1 token
    assert m.add_sequence("plain", prompt) == 0
    assert m.add_sequence("a", prompt, cache_salt=b"lora-a") == 0   # no page of plain's
    assert m.add_sequence("a2", prompt, cache_salt="lora-a") == 8   # a str: its UTF-8 bytes
    assert m.add_sequence("plain2", prompt) == 8
    assert m.add_sequence("empty", prompt, cache_salt=b"") == 0     # b"" is a salt too
    plain, salted = set(m.page_table("plain")[:2]), set(m.page_table("a")[:2])
    assert set(m.page_table("a2")[:2]) == salted and not plain & salted
    m.fork("a", "fork")
    m.append("fork", [20, 21, 22])                                   # fills page 2 under lora-a
    grown = prompt + [20, 21, 22, 5]
    assert m.add_sequence("grown-a", grown, cache_salt=b"lora-a") == 12
    assert m.add_sequence("grown-plain", grown) == 8
    m.take_pending_copies()                                          # a forward wrote their KV
    record = m.detach("a2")
    assert record.cache_salt == b"lora-a"
    pages, fresh = m.attach("a2", record, reuse_cached=True)
    assert fresh.tolist() == [False, False, True] and set(pages[:2]) == salted
    m.free("a2")                                                     # a record made by hand, a str salt
    pages, fresh = m.attach("a2", DetachedSequence(9, np.array(prompt, np.int32), "lora-a"), reuse_cached=True)
    assert fresh.tolist() == [False, False, True] and set(pages[:2]) == salted
    assert salted_root(None) == ROOT_KEY and len({salted_root(s) for s in (None, b"", b"a", b"b")}) == 4
    assert salted_root("a") == salted_root(b"a")
    # no salt's root is a page's key: the salt that spells ROOT_KEY + a page of tokens is not it
    page = np.array([1, 2, 3, 4], "<i4")
    assert salted_root(ROOT_KEY + page.tobytes()) != chain_keys(page, 4)[0]
    m.check()


def test_attach_reuses_a_restored_page_in_the_step_it_came_back():
    """restore_cached's pages hold their KV at once (the tier copies it in): attach reuses them in
    the same step, even on a page last handed out (and discarded) in that step."""
    m = KVCacheManager(num_pages=4, page_size=4, max_seqs=4, max_pages_per_seq=4)
    m.add_sequence("a", [0, 1, 2, 3, 0])
    m.take_pending_copies()
    key = chain_keys(np.array([0, 1, 2, 3]), 4)[0]
    record = m.detach("a")
    m.clear_prefix_cache()
    m.add_sequence("x", [0, 1, 2, 3, 0])         # cached when handed out in this step
    page = int(m.page_table("x")[0])
    m.discard("x", 0)                           # its forward failed
    restored = m.restore_cached([key])
    assert restored.tolist() == [page]          # the same page, back from a tier
    pages, fresh = m.attach("a", record, reuse_cached=True)
    assert fresh.tolist() == [False, True] and pages[0] == page
    m.check()


def test_kv_sources_name_the_queued_copys_source_and_leave_the_queue():
    m = KVCacheManager(num_pages=8, page_size=4, max_seqs=4, max_pages_per_seq=4)
    m.add_sequence("a", list(range(6)))
    m.fork("a", "b")
    m.append("b", [9])                          # b's partial page waits for its copy
    a, b = m.page_table("a"), m.page_table("b")
    assert m.kv_sources(b).tolist() == a.tolist() and m.kv_sources(a).tolist() == a.tolist()
    assert m.kv_sources(np.zeros(0, np.int32)).tolist() == []
    for pages, error in (([8], InvalidPageError), ([-1], InvalidPageError), ([[0]], ValueError),
                         ([0.5], ValueError)):
        with pytest.raises(error, match="expected"):
            m.kv_sources(np.array(pages))
    src, dst = m.take_pending_copies()
    assert src.tolist() == [a[1]] and dst.tolist() == [b[1]]
    assert m.kv_sources(b).tolist() == b.tolist()


def test_discard_takes_unwritten_pages_out_of_the_prefix_cache_and_keeps_the_hits():
    """A prompt whose forward failed before writing its KV: its full pages entered the prefix cache
    when handed out; discard takes them out (a later prompt must not hit KV that is not there),
    while the pages it found in the cache stay cached."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", list(range(9)))
    hit_pages = m.page_table("a")[:2].tolist()
    assert m.add_sequence("b", list(range(8)) + [50, 51, 52, 53, 54]) == 8   # hits a's 2 pages
    own = int(m.page_table("b")[2])                                        # full, cached, unwritten
    m.discard("b", 8)
    assert m.seq_len("b") == 8 and own not in m.prefix.key_of and m.allocator.is_free([own]).tolist() == [True]
    assert all(page in m.prefix.key_of for page in hit_pages)
    m.free("b")
    assert m.add_sequence("c", list(range(8)) + [50, 51, 52, 53, 54]) == 8  # no hit on the third page
    m.add_sequence("d", [70, 71, 72, 73, 74])
    m.discard("d", 0)                                                      # nothing written: freed,
    assert "d" not in m and len(m.prefix) == 3                             # its full page uncached
    m.check()


def test_discard_to_nothing_keeps_the_pages_a_sequence_did_not_hand_out_itself_cached():
    """Freed with discard(0), a sequence takes out of the prefix cache only the pages it handed
    out: its prefix hits, a fork's inherited pages and an attach's pages came written and stay
    cached for the next prompt (they used to leave the cache with it)."""
    m = KVCacheManager(num_pages=32, page_size=4, max_seqs=8, max_pages_per_seq=8)
    m.add_sequence("a", list(range(9)))                       # 2 full pages, written
    m.take_pending_copies()
    cached = dict(m.prefix.page_of)
    m.add_sequence("hit", list(range(8)) + [60])              # a's 2 pages, and its own partial one
    m.fork("a", "child")
    m.append("child", [61, 62, 63])                           # fills a page of its own (cached)
    own = int(m.page_table("child")[2])
    record = m.detach("a")
    m.attach("back", record, reuse_cached=True)               # a's 2 pages again
    for seq_id in ("hit", "child", "back"):
        m.discard(seq_id, 0)
        assert seq_id not in m and m.prefix.page_of.items() >= cached.items(), seq_id
    assert own not in m.prefix.key_of
    assert m.add_sequence("again", list(range(8)) + [70]) == 8
    m.truncate("again", 3)                                    # back into its first (hit) page
    m.append("again", [99])                                   # refilled on a copy of its own
    refilled = int(m.page_table("again")[0])
    assert refilled in m.prefix.key_of
    m.discard("again", 3)                                     # not written: out of the cache
    assert refilled not in m.prefix.key_of and m.prefix.page_of.items() >= cached.items()
    m.check()


def test_discard_of_an_append_takes_out_the_page_it_filled_and_keeps_the_page_before():
    """Tokens appended into a partly written page fill it (cached at once) and start another; the
    forward fails: the filled page leaves the cache (its tail is unwritten), the written one stays."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    m.add_sequence("a", list(range(6)))
    def state():
        return (m.page_table("a").tolist(), sorted(m.allocator.free_pages().tolist()),
                dict(m.prefix.page_of), list(m.prefix.evictable), m.stats())

    before = state()
    m.append("a", [6, 7, 8])                    # fills page 1 (cached), starts page 2
    filled = int(m.page_table("a")[1])
    assert filled in m.prefix.key_of
    m.discard("a", 6)
    assert state() == before                    # as before the append
    for bad in (-1, 7, 2.0, True):
        with pytest.raises(ValueError, match=r"expected num_written an integer in \[0, 6\]"):
            m.discard("a", bad)
    assert state() == before
    m.check()


def test_the_prefix_cache_evicts_exactly_what_is_asked_preferred_pages_then_runs():
    """PrefixCache.evict on its own: preferred pages first (no more than asked, however many are
    preferred), then runs from the least recently released page, cut at the count, last page
    first; asked for more than it has, it returns what it has."""
    cache = PrefixCache()
    for page in (7, 3, 4, 5, 6, 9):
        cache.insert(bytes([page]) * 16, page)
        cache.evictable[page] = None
    evicted = cache.evict(1, prefer=[9, 6])
    assert [page for _, page in evicted] == [9] and evicted[0][0] == bytes([9]) * 16
    assert [page for _, page in cache.evict(2, keep={4})] == [7, 3]      # 3's run stops at 4
    assert [page for _, page in cache.evict(2)] == [5, 4]                # the run 4, 5, 6, cut at 2
    assert [page for _, page in cache.evict(5)] == [6] and not cache.evictable and not len(cache)


@pytest.mark.parametrize("corrupt, message", [
    (lambda m: m.allocator.incref([0]), "page 0: refcount 3, expected 2"),
    (lambda m: m.prefix.evictable.pop(4), "cached page 4 is not evictable with 0 other holders"),
    (lambda m: m.prefix.evictable.update({0: None}), "cached page 0 is evictable with 1 other holders"),
    (lambda m: m._page_keys[m._rows["a"]].pop(), "sequence 'a' has 1 page keys for 2 full pages"),
])
def test_check_finds_each_broken_invariant(corrupt, message):
    m = KVCacheManager(num_pages=8, page_size=2, max_seqs=2, max_pages_per_seq=4)
    m.add_sequence("a", [1, 2, 3, 4, 5])
    m.add_sequence("b", [6, 7, 8])
    m.free("b")                                   # its full page 4 stays cached, evictable
    m.check()
    corrupt(m)
    with pytest.raises(InvariantError, match=message):
        m.check()


def test_a_sequence_truncated_into_restored_pages_rekeys_them_from_its_own_tokens():
    """Pages a second tier restores come back without token ids; a prompt that hits them supplies
    its own, so a rollback into them and the same tokens again give the same keys, no new ones."""
    m = KVCacheManager(num_pages=16, page_size=4, max_seqs=2, max_pages_per_seq=8)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    keys = chain_keys(prompt, 4)
    m.restore_cached(keys)                          # 2 full pages, as a tier would put them back
    assert m.add_sequence("a", prompt) == 8
    m.truncate("a", 6)                              # into the second restored page
    m.append("a", [11, 12, 13])                     # its own tokens again: a copy, the same key
    assert set(m.prefix.page_of) == set(keys) and m.prefix.page_of[keys[1]] != m.page_table("a")[1]
    m.check()
