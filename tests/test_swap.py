"""The second tier: swap round trips keep every byte, failures change nothing, a background prefetch
racing with other work corrupts nothing, spilled prefixes come back, tier files survive a restart
and damaged ones are refused."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagekv import (
    InvalidPageError, InvariantError, KVCache, KVCacheManager, KVCacheSpec, OutOfPagesError, PageStateError,
    UnknownSequenceError)
from pagekv.prefix import chain_keys, salted_root
from pagekv.swap import TieredKVCache
from pagekv.tier import OffloadTier, TierFileError
from wrong_values import MUTATIONS, SEQ_ID_LISTS, refusal_problem

SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)


def tiered(*, hot_pages=32, tier_pages=32, dtype="float32", path=None, max_seqs=16, spill="all"):
    spec = KVCacheSpec(dtype=dtype, **SPEC)
    manager = KVCacheManager(num_pages=hot_pages, page_size=spec.page_size, max_seqs=max_seqs,
                             max_pages_per_seq=hot_pages)
    cache = KVCache(spec, hot_pages)
    tier = OffloadTier(spec, tier_pages, path=path)
    return TieredKVCache(manager, cache, tier, spill_prefixes=spill)


def fill(t, seq_id, rng):
    """A step's forward: the step begins (``take_pending_copies``; these tests queue no copies
    before it, so a copy the step drops would show) and random bytes go in every page of
    ``seq_id`` (all layers, K and V); returns its KV [L, 2, n, ...]."""
    assert [x.tolist() for x in t.manager.take_pending_copies()] == [[], []]
    table = t.manager.page_table(seq_id)
    data = t.cache.data
    shape = data[:, :, table].shape
    data[:, :, table] = (rng.standard_normal(shape).astype(np.float32) if data.dtype == np.float32
                         else rng.integers(0, 2**(8 * data.itemsize), size=shape).astype(data.dtype))
    return kv_of(t, seq_id)


def kv_of(t, seq_id):
    return t.cache.data[:, :, t.manager.page_table(seq_id)].copy()


def forget_free_pages(t):
    """Overwrite the hot pages in the pool (what swapped-out sequences left behind, anyone's next);
    cached and held pages keep their KV, as they do."""
    free = t.manager.allocator.free_pages()
    t.cache.data[:, :, free] = 0 if t.cache.data.dtype != np.float32 else np.nan


def snapshot(t):
    """Everything a failed call must leave as it was."""
    m = t.manager
    return (m.stats(), {s: m.page_table(s).tolist() for s in m.seq_ids()}, m.allocator.free_pages().tolist(),
            t.tier.allocator.free_pages().tolist(), dict(t.tier.prefixes), dict(t._swapped))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("file_backed", [False, True])
def test_swap_round_trip_keeps_every_byte_through_forks_and_prefix_hits(tmp_path, dtype, file_backed):
    rng = np.random.default_rng(0)
    t = tiered(dtype=dtype, path=tmp_path / "tier.bin" if file_backed else None)
    m = t.manager
    m.add_sequence("a", list(range(13)))                  # 4 pages, the last partial
    m.add_sequence("b", list(range(8)) + [99, 98])       # shares a's first 2 pages (prefix hit)
    m.fork("a", "c")                                      # shares every page of a
    expected = {s: fill(t, s, rng) for s in ("a",)}
    expected["b"] = kv_of(t, "b")
    expected["c"] = kv_of(t, "c")
    t.swap_out(["a", "b"])
    assert t.is_swapped("a") and "a" not in m and not t.is_ready("a")
    m.check()
    forget_free_pages(t)
    m.add_sequence("d", list(range(500, 520)))           # someone else takes hot pages meanwhile
    t.prefetch(["b", "a"])
    t.wait()
    assert t.is_ready("a") and t.is_ready("b")
    for seq_id in ("a", "b"):
        np.testing.assert_array_equal(kv_of(t, seq_id), expected[seq_id])
        assert m.seq_len(seq_id) == expected[seq_id].shape[2] * 4 - (3 if seq_id == "a" else 2)
    assert t.tier.allocator.num_free == t.tier.num_pages  # the tier gave every page back
    # a's 3 full pages (b's first 2 among them) are cached, held by c: shared again, not copied
    assert m.page_table("a")[:3].tolist() == m.page_table("c")[:3].tolist() == \
        m.page_table("b")[:2].tolist() + [m.page_table("a")[2]]
    page = t.cache.spec.bytes_per_page
    # only the 2 partial pages crossed each way: the full ones stayed in the hot prefix cache
    assert (t.bytes_swapped_out, t.bytes_swapped_in) == (2 * page, 2 * page)
    m.append_tokens(["a"], [13])  # a continues where it stopped
    m.check()


def test_forks_swapped_together_share_their_pages_in_the_tier_and_back():
    rng = np.random.default_rng(5)
    t = tiered(hot_pages=32, tier_pages=32)
    m = t.manager
    m.add_sequence("a", list(range(30)))                # 8 pages, the last holding 2 tokens
    expected = {"a": fill(t, "a", rng)}
    for fork in ("b", "c"):
        m.fork("a", fork)
        expected[fork] = expected["a"]
    hot_used = m.allocator.num_used
    before = snapshot(t)
    t.swap_out([])                                      # nothing to do (it used to ask for 0 pages)
    assert snapshot(t) == before
    t.swap_out(["a", "b", "c"])
    assert t.tier.allocator.num_used == 8               # each shared page once (was 24)
    assert t.tier.allocator.refcount(t._swapped["a"][1]).tolist() == [3] * 8
    forget_free_pages(t)
    t.prefetch(["a", "b"])                              # together: they share again
    t.wait()
    assert m.allocator.num_used - m.stats().pages_cached == 8
    assert m.page_table("a").tolist() == m.page_table("b").tolist()
    t.prefetch(["c"])                                   # alone: the 7 full pages from the prefix
    t.wait()                                            # cache, its partial last page its own
    c, a = m.page_table("c").tolist(), m.page_table("a").tolist()
    assert c[:7] == a[:7] and c[7] != a[7]
    assert t.tier.allocator.num_free == t.tier.num_pages and hot_used == 8
    assert t.bytes_swapped_in == 2 * t.cache.spec.bytes_per_page
    for seq_id in ("a", "b", "c"):
        np.testing.assert_array_equal(kv_of(t, seq_id), expected[seq_id])
    m.append("a", [30])                                 # a's last page is b's too: copied first
    src, dst = m.take_pending_copies()
    assert src.tolist() == [m.page_table("b")[-1]] and dst.tolist() == [m.page_table("a")[-1]]
    m.check()


def test_swap_out_reads_a_page_that_waits_for_its_copy_from_the_source():
    """A fork appended to (its shared partial page copied: a queued copy) and then cut back with
    discard (its forward failed) keeps tokens that only the copy brings; swapped out before the
    step runs the copies, it takes them along from the copy's source, and the other copies stay
    queued for that step (taking them there would end the step early: see test_manager's reuse
    tests)."""
    rng = np.random.default_rng(6)
    t = tiered()
    m = t.manager
    m.add_sequence("a", list(range(6)))                 # a full page and 2 tokens
    kv = fill(t, "a", rng)
    m.fork("a", "b")
    m.fork("a", "c")
    m.append("b", [60])                                 # b's copy of the partial page is queued
    m.append("c", [61])                                 # and c's
    m.discard("b", 6)
    t.swap_out(["b"])
    src, dst = m.take_pending_copies()                  # c's copy only: b's went with its page
    assert src.tolist() == [m.page_table("a")[1]] and dst.tolist() == [m.page_table("c")[1]]
    forget_free_pages(t)
    t.prefetch(["b"])
    t.wait()
    got = kv_of(t, "b")
    np.testing.assert_array_equal(got[:, :, 0], kv[:, :, 0])
    np.testing.assert_array_equal(got[:, :, 1, :, :2], kv[:, :, 1, :, :2])
    m.check()


@pytest.mark.parametrize("leaves", ["evicted", "cleared", "stays"])
def test_cached_pages_stay_hot_at_swap_out_and_cross_only_if_they_leave_the_cache(leaves):
    """swap_out copies only a's partial page: its 2 full pages stay in the hot prefix cache, tier
    pages set aside for them. Evicted or cleared before the prefetch, they are copied to the tier
    as they go, and come back from it; left alone, the prefetch shares them again."""
    rng = np.random.default_rng(7)
    t = tiered(hot_pages=6, tier_pages=8, spill="none")
    m = t.manager
    m.add_sequence("a", list(range(9)))                 # 2 full pages + 1 token
    kv = fill(t, "a", rng)
    page = t.cache.spec.bytes_per_page
    t.swap_out(["a"])
    assert t.bytes_swapped_out == page and t.tier.allocator.num_used == 3 and m.stats().pages_cached == 2
    if leaves == "evicted":
        m.add_sequence("filler", list(range(100, 124)))  # 6 pages: evicts both
        m.free("filler")
    elif leaves == "cleared":
        m.clear_prefix_cache()
    assert t.bytes_swapped_out == (page if leaves == "stays" else 3 * page)
    forget_free_pages(t)
    t.prefetch(["a"])
    t.wait()
    np.testing.assert_array_equal(kv_of(t, "a"), kv)
    assert t.bytes_swapped_in == (page if leaves == "stays" else 3 * page)
    assert t.tier.allocator.num_free == t.tier.num_pages
    m.check()


def test_a_freed_swapped_sequence_gives_back_the_tier_pages_set_aside_for_it():
    """Freed while swapped, a sequence's set-aside tier pages go back to the tier; its full pages
    leaving the hot cache later must not be copied into them (another sequence's KV may be there)."""
    rng = np.random.default_rng(8)
    t = tiered(hot_pages=8, tier_pages=3, spill="none")
    m = t.manager
    m.add_sequence("a", list(range(9)))
    fill(t, "a", rng)
    t.swap_out(["a"])                                   # 3 tier pages, 2 of them set aside
    t.free("a")
    assert t.tier.allocator.num_free == 3
    m.add_sequence("b", [50, 51, 52])                   # a partial page: copied at swap-out
    kv = fill(t, "b", rng)
    m.add_sequence("c", [60, 61, 62])
    kv_c = fill(t, "c", rng)
    t.swap_out(["b", "c"])                              # onto tier pages a had set aside
    m.clear_prefix_cache()                              # a's full pages leave the hot cache
    t.prefetch(["b", "c"])
    t.wait()
    np.testing.assert_array_equal(kv_of(t, "b"), kv)
    np.testing.assert_array_equal(kv_of(t, "c"), kv_c)
    m.check()


def test_a_page_set_aside_and_evicted_is_spilled_on_the_tier_page_it_was_copied_to():
    """With spill_prefixes, a's full pages left hot at swap-out and then evicted cross once: the
    spilled prefix is kept on the tier page set aside for it (a second reference), not copied to
    another. Such a page is not room (dropping the prefix frees nothing: a swap-out drops only
    prefixes alone on their pages, and refuses what they cannot make room for), the prefix comes
    back on a hit, and the swapped sequence comes back whole."""
    rng = np.random.default_rng(9)
    t = tiered(hot_pages=6, tier_pages=5)
    m = t.manager
    page = t.cache.spec.bytes_per_page
    m.add_sequence("p", [200, 201, 202, 203, 204])      # 1 full page + 1 token
    fill(t, "p", rng)
    m.free("p")                                         # its full page stays cached
    m.add_sequence("a", list(range(9)))                 # 2 full pages + 1 token
    kv = fill(t, "a", rng)
    t.swap_out(["a"])                                   # 1 page copied, 2 set aside
    m.add_sequence("filler", list(range(100, 124)))     # 6 pages: evicts p's page and a's two
    assert t.bytes_swapped_out == 3 * page and t.bytes_spilled == page  # p's page: a tier page of its own
    refs = t.tier.allocator.refcount(list(t.tier.prefixes.values()))
    assert sorted(refs.tolist()) == [1, 2, 2] and t.tier.allocator.num_used == 4
    assert t.tier.droppable_pages() == 1
    t.check()
    m.free("filler")
    m.clear_prefix_cache()
    m.add_sequence("b", [60, 61, 62])
    kv_b = fill(t, "b", rng)
    m.add_sequence("c", [70, 71, 72])
    kv_c = fill(t, "c", rng)
    m.add_sequence("d", [80, 81, 82])
    fill(t, "d", rng)
    before = snapshot(t)
    with pytest.raises(OutOfPagesError):
        t.swap_out(["b", "c", "d"])                     # 3 pages: 1 free, the prefixes free only 1
    assert snapshot(t) == before
    t.swap_out(["b", "c"])                              # the free page and p's, its prefix dropped
    assert len(t.tier.prefixes) == 2 and t.tier.allocator.num_free == 0
    t.check()
    assert t.add_sequence("again", list(range(9))) == 8  # a's two come back from the tier
    assert not t.tier.prefixes and t.tier.allocator.num_used == 5  # a, b and c still hold theirs
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :2], kv[:, :, :2])
    m.free("d")
    forget_free_pages(t)
    t.prefetch(["a", "b", "c"])                         # a shares the 2 restored pages
    t.wait()
    np.testing.assert_array_equal(kv_of(t, "a"), kv)
    np.testing.assert_array_equal(kv_of(t, "b"), kv_b)
    np.testing.assert_array_equal(kv_of(t, "c"), kv_c)
    assert t.bytes_swapped_in == 3 * page and t.tier.allocator.num_free == 5
    t.check()


def test_check_finds_a_tier_reference_gone_astray():
    """TieredKVCache.check audits the tier's counts against its swapped sequences and prefixes."""
    t = tiered(hot_pages=6, tier_pages=4)
    t.manager.add_sequence("a", list(range(6)))
    fill(t, "a", np.random.default_rng(10))
    t.swap_out(["a"])
    t.check()
    t.tier.allocator.incref(t._swapped["a"][1][:1])
    with pytest.raises(InvariantError, match="refcount 2, expected 1"):
        t.check()


@pytest.mark.parametrize("damage", ["freed", "not inverse", "not cached"])
def test_check_finds_pages_set_aside_gone_wrong(damage):
    t = tiered(hot_pages=6, tier_pages=4, spill="none")
    t.manager.add_sequence("a", list(range(9)))
    fill(t, "a", np.random.default_rng(11))
    t.swap_out(["a"])
    t.check()
    aside = t._set_aside
    key, cold = next(iter(aside.cold_of.items()))
    if damage == "freed":
        t.tier.allocator.decref([cold])  # its one reference (a's) gone behind the tier's back
        match = "expected tier pages set aside to be held, got free page"
    elif damage == "not inverse":
        aside.key_of[cold] = bytes(16)
        match = "expected the set-aside maps to be inverses"
    else:
        del aside.cold_of[key], aside.key_of[cold]
        aside.cold_of[bytes(16)], aside.key_of[cold] = cold, bytes(16)
        match = "expected the hot prefix cache to hold every page set aside, got 1 gone uncopied"
    with pytest.raises(InvariantError, match=match):
        t.check()


def test_a_fork_swapped_out_after_its_source_needs_no_tier_page_of_its_own():
    """a's two full pages stay hot, set aside; its fork b, swapped out next, finds both set aside
    already: no tier page to take (taking none used to raise), one more reference on each."""
    t = tiered(hot_pages=8, tier_pages=8)
    m = t.manager
    m.add_sequence("a", list(range(8)))                 # exactly 2 full pages
    kv = fill(t, "a", np.random.default_rng(16))
    m.fork("a", "b")
    t.swap_out(["a"])
    t.swap_out(["b"])
    assert t.tier.allocator.num_used == 2 and t.bytes_swapped_out == 0
    t.check()
    t.prefetch(["a", "b"])
    t.wait()
    np.testing.assert_array_equal(kv_of(t, "a"), kv)
    np.testing.assert_array_equal(kv_of(t, "b"), kv)
    assert t.tier.allocator.num_free == 8 and t.bytes_swapped_in == 0
    t.check()


def test_swap_failures_change_nothing():
    t = tiered(hot_pages=12, tier_pages=3)
    m = t.manager
    m.add_sequence("a", list(range(9)))   # 3 pages
    m.add_sequence("b", list(range(50, 57)))  # 2 pages
    before = snapshot(t)
    with pytest.raises(OutOfPagesError):
        t.swap_out(["b", "a"])           # 5 pages, the tier has 3
    with pytest.raises(UnknownSequenceError):
        t.swap_out(["a", "nope"])
    with pytest.raises(ValueError, match="repeated"):
        t.swap_out(["a", "a"])
    assert snapshot(t) == before
    t.swap_out(["a"])
    m.add_sequence("big", list(range(100, 136)))  # 9 pages: 1 hot page left, 'a' needs 3
    before = snapshot(t)
    with pytest.raises(OutOfPagesError):
        t.prefetch(["a"])
    with pytest.raises(UnknownSequenceError):
        t.prefetch(["b"])                 # hot, not swapped
    assert snapshot(t) == before
    t.free("a")                           # a swapped sequence frees its tier pages but the one
    assert len(t.tier.prefixes) == 1      # where its page big evicted is kept as a spilled prefix
    assert t.tier.allocator.num_free == 2 and not t.is_swapped("a")


def test_prefetch_racing_with_appends_frees_and_swaps_corrupts_nothing():
    rng = np.random.default_rng(1)
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16, dtype="float32")
    manager = KVCacheManager(num_pages=1200, page_size=16, max_seqs=64, max_pages_per_seq=1024)
    t = TieredKVCache(manager, KVCache(spec, 1200), OffloadTier(spec, 1200))
    manager.add_sequence("long", rng.integers(0, 1000, 16 * 1000).tolist())  # 1000 pages: a long copy
    expected = fill(t, "long", rng)
    t.swap_out(["long"])
    manager.clear_prefix_cache()  # its full pages leave the hot cache: the prefetch copies all back
    for s in range(20):
        manager.add_sequence(s, rng.integers(0, 1000, 30).tolist())
    others = {s: fill(t, s, rng) for s in range(20)}
    t.prefetch(["long"])
    raced = 0
    for step in range(40):  # work on other sequences while the copy runs
        if not t.is_ready("long"):
            raced += 1
        live = [s for s in range(20) if s in manager]
        slots = manager.append_tokens(live, [step] * len(live))
        t.cache.data[:, :, slots // 16, :, slots % 16] = step  # write their new tokens' KV
        if step % 10 == 9:
            t.free(live[0])
            del others[live[0]]
        if step == 20:
            t.swap_out([live[-1]])
            t.prefetch([live[-1]])
    t.wait()
    np.testing.assert_array_equal(kv_of(t, "long"), expected)
    for s, kv in others.items():  # their first 30 tokens (2 pages) are untouched by the race
        got = kv_of(t, s)
        np.testing.assert_array_equal(got[:, :, :1], kv[:, :, :1])
    manager.check()
    assert raced > 0, "the prefetch finished before any racing work: the test proved nothing"


def test_evicted_prefix_pages_spill_to_the_tier_and_come_back():
    rng = np.random.default_rng(2)
    t = tiered(hot_pages=8, tier_pages=8)
    m = t.manager
    prompt = list(range(12)) + [7]                      # 3 full pages + 1 token
    m.add_sequence("p", prompt)
    kv = fill(t, "p", rng)
    m.free("p")                                         # 3 full pages stay cached (evictable)
    m.add_sequence("filler", list(range(300, 332)))     # 8 pages: evicts all three
    assert len(t.tier.prefixes) == 3 and t.bytes_spilled == 3 * t.cache.spec.bytes_per_page
    m.free("filler")
    m.clear_prefix_cache()
    hit = t.add_sequence("again", prompt)
    assert hit == 12
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :3], kv[:, :, :3])
    assert not t.tier.prefixes and t.tier.allocator.num_free == 8  # moved back, tier pages freed
    m.check()


def _with_spilled_prompt(prompt, *, hot_pages=8, cache_salt=None):
    """A tiered cache whose tier holds ``prompt``'s full pages (spilled), and one live sequence."""
    t = tiered(hot_pages=hot_pages, tier_pages=32)
    m = t.manager
    m.add_sequence("p", prompt, cache_salt=cache_salt)
    kv = fill(t, "p", np.random.default_rng(4))
    m.free("p")
    m.add_sequence("filler", list(range(300, 300 + 4 * hot_pages)))  # evicts (spills) them all
    m.free("filler")
    m.add_sequence("live", [1, 2, 3])
    return t, kv


def test_spilled_pages_come_back_only_under_their_cache_salt():
    prompt = list(range(12)) + [7]                      # 3 full pages + 1 token
    t, kv = _with_spilled_prompt(prompt, cache_salt=b"lora-a")
    keys = chain_keys(np.array(prompt), 4, salted_root(b"lora-a"))[:3]
    assert all(key in t.tier.prefixes for key in keys)
    assert t.add_sequence("plain", prompt) == 0         # other KV: nothing comes back
    t.manager.free("plain")
    assert t.add_sequence("other", prompt, cache_salt="lora-b") == 0
    t.manager.free("other")
    assert all(key in t.tier.prefixes for key in keys) and t.bytes_restored == 0
    with pytest.raises(TypeError, match="expected cache_salt None, bytes or str, got float 1.5"):
        t.add_sequence("bad", prompt, cache_salt=1.5)
    assert all(key in t.tier.prefixes for key in keys) and "bad" not in t.manager
    assert t.add_sequence("again", prompt, cache_salt="lora-a") == 12
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :3], kv[:, :, :3])
    assert t.bytes_restored == 3 * t.cache.spec.bytes_per_page
    t.check()


@pytest.mark.parametrize("tail_in_tier_too", [False, True])
def test_a_prompt_whose_head_is_spilled_and_tail_hot_comes_back_whole(tail_in_tier_too):
    """The hot cache can hold a chain's later pages after evicting its head (eviction is by
    release order and page runs, not by chain). A prompt then finds pages 0 and 1 in the tier and
    page 2 hot (maybe in the tier as well): the first two come back, page 2 is kept, and all
    three are hits. (The tier used to leave page 2 evictable while it brought the others back, or
    to bring back page 2 as well, which the manager refused, and the tier pages it had taken out
    for them were lost.)"""
    prompt = list(range(12)) + [7]                      # 3 full pages + 1 token
    t, kv = _with_spilled_prompt(prompt)
    keys = chain_keys(np.array(prompt), 4)[:3]
    cold = t.tier.prefixes[keys[2]]                     # page 2 alone comes back to the hot cache
    hot = t.manager.restore_cached([keys[2]])
    t.cache.data[:, :, hot] = t.tier.data[:, :, [cold]]
    if not tail_in_tier_too:
        t.tier.allocator.decref([t.tier.take_prefix(keys[2])])
    assert t.add_sequence("again", prompt) == 12
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :3], kv[:, :, :3])
    assert t.manager.page_table("again")[2] == hot[0] and t.bytes_restored == 2 * t.cache.spec.bytes_per_page
    assert [key in t.tier.prefixes for key in keys] == [False, False, tail_in_tier_too]
    assert t.tier.allocator.num_used == len(t.tier.prefixes)
    t.check()


def test_spill_keeps_what_the_tier_has_room_for_heads_first_and_restores_up_to_a_gap():
    """A tier with room for one page keeps the evicted prompt's first page (a later prompt needs
    the head first); with no room it keeps nothing and the eviction goes on. A prompt whose second
    page is nowhere gets its first back, not its third (no hit can reach it)."""
    prompt = list(range(12)) + [7]                      # 3 full pages + 1 token
    keys = chain_keys(np.array(prompt), 4)[:3]
    t = tiered(hot_pages=8, tier_pages=1)
    m = t.manager
    m.add_sequence("p", prompt)
    kv = fill(t, "p", np.random.default_rng(12))
    m.free("p")
    m.add_sequence("filler", list(range(300, 332)))     # 8 pages: evicts all three at once
    assert list(t.tier.prefixes) == [keys[0]] and t.bytes_spilled == t.cache.spec.bytes_per_page
    m.free("filler")
    m.clear_prefix_cache()
    assert t.add_sequence("again", prompt) == 4
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :1], kv[:, :, :1])
    m.add_sequence("x", [50, 51])
    fill(t, "x", np.random.default_rng(13))
    t.swap_out(["x"])                                   # the tier's one page: no room left
    m.free("again")
    m.add_sequence("filler-2", list(range(400, 432)))   # evicts again's pages: none kept
    assert not t.tier.prefixes and t.bytes_spilled == t.cache.spec.bytes_per_page
    t.check()

    t, kv = _with_spilled_prompt(prompt)
    t.tier.allocator.decref([t.tier.take_prefix(keys[1])])  # a gap: page 1 is nowhere
    assert t.add_sequence("again", prompt) == 4
    assert t.bytes_restored == t.cache.spec.bytes_per_page and keys[2] in t.tier.prefixes
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :1], kv[:, :, :1])
    t.check()


def test_spill_reused_keeps_the_evicted_pages_a_prompt_hit():
    """Under "reused" (the default) only evicted pages a prompt hit while hot are copied to the
    tier: a prompt asked for twice, not one asked for once; a page set aside at swap-out is kept
    all the same (its copy is made anyway). A clear forgets the hits on the pages it drops."""
    rng = np.random.default_rng(14)
    t = tiered(hot_pages=10, tier_pages=16, spill="reused")
    m = t.manager
    prompts = {"twice": list(range(9)), "once": list(range(100, 109)), "aside": list(range(200, 209))}
    keys = {name: set(chain_keys(np.array(tokens), 4)[:2]) for name, tokens in prompts.items()}
    t.add_sequence("twice", prompts["twice"])           # 2 full pages + 1 token each
    kv = fill(t, "twice", rng)
    assert t.add_sequence("twice-again", prompts["twice"]) == 8  # hit: its pages are reused
    for name in ("once", "aside"):
        t.add_sequence(name, prompts[name])
        fill(t, name, rng)
    t.swap_out(["aside"])                               # its 2 full pages stay hot, set aside
    for seq_id in ("twice", "twice-again", "once"):
        m.free(seq_id)
    m.add_sequence("filler", list(range(300, 340)))     # 10 pages: evicts every cached page
    assert set(t.tier.prefixes) == keys["twice"] | keys["aside"]
    assert t.bytes_spilled == 2 * t.cache.spec.bytes_per_page  # aside's pages were copied already
    m.free("filler")
    assert t.add_sequence("back", prompts["twice"]) == 8
    np.testing.assert_array_equal(kv_of(t, "back")[:, :, :2], kv[:, :, :2])
    t.check()

    t = tiered(hot_pages=10, tier_pages=16, spill="reused")
    t.add_sequence("a", prompts["twice"])
    fill(t, "a", rng)
    assert t.add_sequence("b", prompts["twice"]) == 8
    t.manager.free("a")
    t.manager.free("b")
    t.manager.clear_prefix_cache()                      # the pages and their hits are forgotten
    t.add_sequence("c", prompts["twice"])               # cached again, and asked for once since
    fill(t, "c", rng)
    t.manager.free("c")
    t.manager.add_sequence("filler", list(range(300, 340)))
    assert not t.tier.prefixes and t.bytes_spilled == 0
    t.check()

    t = tiered(hot_pages=10, tier_pages=16, spill="reused")  # hits count for one stay in the cache
    t.add_sequence("a", prompts["twice"])
    fill(t, "a", rng)
    assert t.add_sequence("b", prompts["twice"]) == 8
    t.manager.free("a")
    t.manager.free("b")
    t.manager.add_sequence("filler", list(range(300, 340)))  # evicted: spilled
    t.manager.free("filler")
    assert set(t.tier.prefixes) == keys["twice"]
    t.tier.evict_prefixes(2)                            # and dropped from the tier
    assert t.add_sequence("c", prompts["twice"]) == 0   # computed again, asked for once since
    fill(t, "c", rng)
    t.manager.free("c")
    t.manager.add_sequence("filler-2", list(range(400, 440)))
    assert not t.tier.prefixes
    t.check()


def test_spill_reused_forgets_hits_on_pages_that_left_the_cache_unseen():
    """A discard uncaches pages with no hook: their keys leave the reused set once they would
    be half of it, so it stays the size of the hot cache."""
    t = tiered(hot_pages=10, tier_pages=16, spill="reused")
    t.add_sequence("a", list(range(9)))
    fill(t, "a", np.random.default_rng(15))
    t.add_sequence("b", list(range(9)))
    stale = {bytes([i]) * 16 for i in range(200)}      # keys of pages no longer cached
    t._spill.reused |= stale
    t.add_sequence("c", list(range(9)))
    assert t._spill.reused == set(chain_keys(np.arange(9), 4)[:2])


def test_a_prefix_spilled_again_keeps_one_tier_page():
    """A prefix recomputed in the hot cache while its pages sat in the tier, then evicted again:
    the tier keeps its one copy. (Each such spill used to overwrite the key's entry and leak the
    tier page it had named, for good.)"""
    prompt = list(range(12)) + [7]                      # 3 full pages + 1 token
    t, kv = _with_spilled_prompt(prompt)
    m = t.manager
    keys = chain_keys(np.array(prompt), 4)
    spilled = {key: t.tier.prefixes[key] for key in keys}
    m.add_sequence("again", prompt)                     # recomputed hot: not through the tier
    m.free("again")
    m.add_sequence("filler2", list(range(400, 428)))    # 7 pages: evicts the recomputed ones too
    assert t.tier.allocator.num_used == len(t.tier.prefixes)
    assert all(t.tier.prefixes[key] == page for key, page in spilled.items())  # the first copies
    m.free("filler2")
    m.clear_prefix_cache()
    assert t.add_sequence("back", prompt) == 12
    np.testing.assert_array_equal(kv_of(t, "back")[:, :, :3], kv[:, :, :3])
    assert t.tier.allocator.num_used == len(t.tier.prefixes)
    m.check()
    t.tier.allocator.check()


def test_a_refused_add_sequence_brings_nothing_back_from_the_tier():
    prompt = list(range(12)) + [7]                      # 3 full pages + 1 token
    t, kv = _with_spilled_prompt(prompt)
    assert len(set(t.tier.prefixes) & set(chain_keys(np.array(prompt), 4))) == 3
    before = snapshot(t)
    for seq_id, tokens, error, match in [
            ("live", prompt, ValueError, "expected a new seq_id, got 'live', which is already held"),
            (["a list"], prompt, TypeError, "expected a hashable seq_id"),
            ("new", np.array(prompt, np.float64), TypeError, "expected integer token ids"),
            ("new", prompt + [-5], ValueError, "expected token ids in"),
            ("new", prompt * 3, ValueError, "expected at most 32 tokens")]:
        with pytest.raises(error, match=match):
            t.add_sequence(seq_id, tokens)
        assert snapshot(t) == before
    t.manager.add_sequence("hog", list(range(600, 620)))  # 5 pages: 2 left, the prompt needs 4
    before = snapshot(t)
    with pytest.raises(OutOfPagesError):
        t.add_sequence("new", prompt)
    assert snapshot(t) == before
    t.free("hog")
    assert t.add_sequence("new", prompt) == 12          # now it comes back
    np.testing.assert_array_equal(kv_of(t, "new")[:, :, :3], kv[:, :, :3])
    t.manager.check()


def test_a_prompt_of_whole_pages_leaves_its_last_page_in_the_tier():
    """add_sequence computes a prompt's last token, so the page holding it is not a hit: it is not
    brought back (copied in, then recomputed over) either."""
    prompt = list(range(12))                            # exactly 3 pages
    t, kv = _with_spilled_prompt(prompt)
    last = chain_keys(np.array(prompt), 4)[-1]
    assert t.add_sequence("again", prompt) == 8
    np.testing.assert_array_equal(kv_of(t, "again")[:, :, :2], kv[:, :, :2])
    assert last in t.tier.prefixes and t.bytes_restored == 2 * t.cache.spec.bytes_per_page
    t.manager.check()


def test_a_swapped_out_id_is_not_taken_twice():
    t = _with_one_swapped()
    before = snapshot(t)
    with pytest.raises(ValueError, match="expected a new seq_id, got 's', which is swapped out"):
        t.add_sequence("s", np.arange(9))
    assert snapshot(t) == before
    t.manager.add_sequence("s", np.arange(9))  # the manager alone cannot know the id is swapped
    before = snapshot(t)
    with pytest.raises(ValueError, match="expected sequences not swapped out already, got 's'"):
        t.swap_out(["s"])                       # would have dropped the swapped record's tier pages
    assert snapshot(t) == before


def test_tier_prefix_calls_refuse_bad_input_and_change_nothing():
    tier = OffloadTier(KVCacheSpec(dtype="float32", **SPEC), 4)
    first, second = (int(page) for page in tier.allocator.allocate(2))
    free = int(tier.allocator.free_pages()[0])
    key = bytes(range(16))
    tier.keep_prefix(key, first)

    def state():
        return dict(tier.prefixes), tier.allocator.free_pages().tolist()

    before = state()
    for bad_key, bad_page, error, match in [
            (b"short", second, ValueError, "expected a 16-byte prefix key"),
            (key + b"!", second, ValueError, "expected a 16-byte prefix key"),
            ("0123456789abcdef", second, ValueError, "expected a 16-byte prefix key"),
            (key, 4, InvalidPageError, r"expected page ids in \[0, 4\), got 4"),
            (key, -1, InvalidPageError, r"expected page ids in \[0, 4\), got -1"),
            (key, free, PageStateError, f"expected a tier page the caller allocated, got free page {free}"),
            (key, 1.5, TypeError, "expected an integer dtype")]:
        with pytest.raises(error, match=match):
            tier.keep_prefix(bad_key, bad_page)
        assert state() == before
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="expected count an integer >= 0"):
            tier.evict_prefixes(bad)
        assert state() == before
        with pytest.raises(ValueError, match="expected count an integer >= 0"):
            tier.take(bad)
        assert state() == before
    assert tier.take(0).tolist() == [] and state() == before
    with pytest.raises(KeyError, match="expected the key of a spilled prefix page"):
        tier.take_prefix(bytes(16))
    assert state() == before
    assert tier.evict_prefixes(0) == 0 and state() == before  # nothing asked, nothing freed
    tier.keep_prefix(key, second)  # the same prefix again: the page it named goes back to the tier
    assert tier.prefixes == {key: second} and tier.allocator.is_free([first]).tolist() == [True]
    tier.allocator.incref([second])  # a swapped-out sequence holds the page the prefix is kept on:
    tier.keep_prefix(key, tier.take_prefix(key))  # dropping the prefix would free nothing
    assert tier.droppable_pages() == 0 and tier.evict_prefixes(5) == 0 and tier.prefixes == {key: second}
    tier.allocator.decref([second])
    assert tier.droppable_pages() == 1
    tier.allocator.incref([second, second])  # two swapped-out sequences hold it: kept shared,
    tier.keep_prefix(key, tier.take_prefix(key))
    tier.allocator.decref([tier.take_prefix(key)])  # then taken back: no prefix now, and still held
    other = int(tier.allocator.allocate(1)[0])
    tier.keep_prefix(bytes(16), other)
    assert tier.droppable_pages() == 1  # other's page, not second
    tier.allocator.decref([second, second])
    assert tier.evict_prefixes(5) == 1 and tier.allocator.num_free == 4
    tier.allocator.check()


def test_tier_file_survives_a_restart(tmp_path):
    path, _, prompt, kv = _spilled_file(tmp_path)
    np.save(tmp_path / "kv.npy", kv[:, :, :3])
    script = textwrap.dedent(f"""
        import numpy as np
        from pagekv import KVCache, KVCacheManager, KVCacheSpec
        from pagekv.swap import TieredKVCache
        from pagekv.tier import OffloadTier
        spec = KVCacheSpec(dtype="float32", **{SPEC!r})
        tier = OffloadTier.open({str(path)!r}, spec=spec)
        assert len(tier.prefixes) == 3 and tier.dropped_on_open == 0, tier.prefixes
        manager = KVCacheManager(num_pages=8, page_size=4, max_seqs=4, max_pages_per_seq=8)
        t = TieredKVCache(manager, KVCache(spec, 8), tier)
        assert t.add_sequence("again", {prompt!r}) == 12
        kv = t.cache.data[:, :, manager.page_table("again")[:3]]
        np.testing.assert_array_equal(kv, np.load({str(tmp_path / "kv.npy")!r}))
        print("restored")
    """)
    # -I and another working directory: the new process imports the installed pagekv, never a source tree
    result = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and "restored" in result.stdout, result.stderr


def _spilled_file(tmp_path):
    """A closed file tier holding the 3 full pages of one prompt, spilled from an 8-page hot cache.

    Returns the path, the spec, the prompt and its KV [L, 2, 4 pages, ...] as it was written.
    """
    path = tmp_path / "tier.bin"
    t = tiered(hot_pages=8, tier_pages=8, path=path)
    prompt = list(range(12)) + [7]
    t.manager.add_sequence("p", prompt)
    kv = fill(t, "p", np.random.default_rng(4))
    t.manager.free("p")
    t.manager.add_sequence("filler", list(range(300, 332)))  # spills p's 3 full pages to the file
    t.tier.close()
    return path, t.tier.spec, prompt, kv


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_tier_files_are_refused(tmp_path):
    path, spec, _, _ = _spilled_file(tmp_path)
    good = path.read_bytes()
    path.write_bytes(good[:-100])
    with pytest.raises(TierFileError, match="truncated"):
        OffloadTier.open(path)
    path.write_bytes(b"NOTATIER" + good[8:])
    with pytest.raises(TierFileError, match="expected a pagekv tier file"):
        OffloadTier.open(path)
    path.write_bytes(good)
    _flip(path, 20)
    with pytest.raises(TierFileError, match="corrupted header"):
        OffloadTier.open(path)
    path.write_bytes(good)
    _flip(path, len(good) - 8)                     # inside the page map
    with pytest.raises(TierFileError, match="corrupted page map"):
        OffloadTier.open(path)
    path.write_bytes(good)
    with pytest.raises(TierFileError, match="expected a tier file of"):
        OffloadTier.open(path, spec=KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4,
                                                dtype="float32"))
    with pytest.raises(FileExistsError):
        OffloadTier(spec, 8, path=path)            # never overwrites an existing file


def test_a_page_that_changed_after_the_last_flush_is_dropped_not_trusted(tmp_path):
    path, _, _, _ = _spilled_file(tmp_path)
    tier = OffloadTier.open(path)
    page = next(iter(tier.prefixes.values()))
    tier.data[0, 0, page] += 1  # as if reused after the flush, and the process then stopped
    tier._mmap.flush()
    del tier
    reopened = OffloadTier.open(path)
    assert reopened.dropped_on_open == 1 and len(reopened.prefixes) == 2
    assert reopened.allocator.num_free == reopened.num_pages - 2


def test_bad_arguments_are_refused_with_what_was_expected(tmp_path):
    spec = KVCacheSpec(dtype="float32", **SPEC)
    with pytest.raises(TypeError, match="expected a KVCacheSpec"):
        OffloadTier("spec", 4)
    with pytest.raises(ValueError, match="expected num_pages a positive integer"):
        OffloadTier(spec, 0)
    other = KVCacheSpec(dtype="bfloat16", **SPEC)
    manager = KVCacheManager(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=8)
    with pytest.raises(ValueError, match="expected one spec"):
        TieredKVCache(manager, KVCache(spec, 8), OffloadTier(other, 4))
    with pytest.raises(ValueError, match="expected a manager of 16 pages"):
        TieredKVCache(manager, KVCache(spec, 16), OffloadTier(spec, 4))
    plain = KVCacheManager(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=8,
                           enable_prefix_caching=False)
    with pytest.raises(ValueError, match="expected a manager with prefix caching for spill_prefixes='reused'"):
        TieredKVCache(plain, KVCache(spec, 8), OffloadTier(spec, 4))
    TieredKVCache(plain, KVCache(spec, 8), OffloadTier(spec, 4), spill_prefixes="none")
    for bad in (True, False, "some", None, ["all"]):
        with pytest.raises(ValueError, match=r"expected spill_prefixes in \('reused', 'all', 'none'\), got "):
            TieredKVCache(manager, KVCache(spec, 8), OffloadTier(spec, 4), spill_prefixes=bad)
    with pytest.raises(TierFileError, match="expected a pagekv tier file"):
        (tmp_path / "empty").write_bytes(b"")
        OffloadTier.open(tmp_path / "empty")


def _with_one_swapped():
    t = tiered(hot_pages=16, tier_pages=16, max_seqs=4)
    t.add_sequence("a", np.arange(6))
    t.add_sequence("s", np.arange(3))
    t.swap_out(["s"])
    return t


TIER_CALLS = {"swap_out": dict(seq_ids=["a"]), "prefetch": dict(seq_ids=["s"]),
              "wait": dict(seq_ids=["s"]), "is_ready": dict(seq_id="s"), "is_swapped": dict(seq_id="s"),
              "free": dict(seq_id="a"), "add_sequence": dict(seq_id="c", token_ids=np.arange(5))}


@pytest.mark.parametrize("method", sorted(TIER_CALLS))
def test_every_wrong_argument_is_refused_cleanly(method):
    """Each argument replaced by each wrong value (tests/wrong_values.py): the call works or raises
    ValueError/TypeError/PagekvError saying "expected ..." and leaves the tiers as they were."""
    wrong = []
    for name, value in TIER_CALLS[method].items():
        cases = [(label, mutate(value)) for label, applies, mutate in MUTATIONS if applies(value)]
        for label, bad in cases + SEQ_ID_LISTS * isinstance(value, list):
            t = _with_one_swapped()
            args = {**TIER_CALLS[method], name: bad}
            problem = refusal_problem(lambda: getattr(t, method)(**args), lambda: snapshot(t))
            if problem:
                wrong.append(f"{name}={label}: {problem}")
            t.wait()
            t.manager.check()
    assert not wrong, "\n".join(wrong)


def test_a_ram_tier_larger_than_memory_fails_before_touching_it(tmp_path):
    spec = KVCacheSpec(dtype="float32", num_layers=80, num_kv_heads=8, head_dim=128, page_size=16)
    with pytest.raises(MemoryError, match=r"expected a RAM tier \(path= puts one in a file\) within "
                                          r"the .* GiB available, got 10000000 pages x"):
        OffloadTier(spec, 10**7)  # 100 TB
    small = KVCacheSpec(dtype="float32", **SPEC)
    assert OffloadTier(small, 4, path=tmp_path / "tier").num_pages == 4  # a file is not checked


def test_manager_attach_and_restore_cached_refuse_bad_input_and_change_nothing():
    m = KVCacheManager(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=8)
    m.add_sequence("a", list(range(9)))
    record = m.detach("a")
    m.add_sequence("b", list(range(100, 104)))
    before = (m.stats(), m.allocator.free_pages().tolist(), dict(m.prefix.page_of))
    with pytest.raises(TypeError, match="expected a DetachedSequence"):
        m.attach("a", (9, b"", []))
    with pytest.raises(ValueError, match="already held"):
        m.attach("b", record)
    keys = list(m.prefix.page_of)
    with pytest.raises(ValueError, match="not cached yet"):
        m.restore_cached(keys[:1])
    with pytest.raises(OutOfPagesError):
        m.restore_cached([bytes([i]) * 16 for i in range(8)])
    for records, layout, error, match in [
            (record, [[0, 1, 2]], TypeError, "expected records and page_indices lists"),
            ([record], None, TypeError, "expected records and page_indices lists"),
            ([record], [[0, 1, 2], [0]], ValueError, "expected one record and one page index array"),
            ([record], [[0, 1]], ValueError, "expected 3 distinct page indices"),
            ([record], [[0, 1, 1]], ValueError, "expected 3 distinct page indices"),
            ([record], [[0, -1, 2]], ValueError, "expected 3 distinct page indices"),
            ([record], [[0.0, 1.0, 2.0]], ValueError, "expected 3 distinct page indices"),
            ([record], [[0, 1, 3]], ValueError, "expected page indices 0 .. 3 each named, got index 2")]:
        with pytest.raises(error, match=match):
            m.attach_shared(["a"], records, layout)
    with pytest.raises(ValueError, match="expected 16-byte prefix keys, got b'short'"):
        m.restore_cached([bytes(16), b"short"])
    for bad in (8, -1):
        with pytest.raises(InvalidPageError, match=rf"expected keep's page ids in \[0, 8\), got {bad}"):
            m.restore_cached([bytes(16)], keep=[0, bad])
        with pytest.raises(InvalidPageError, match=rf"expected keep's page ids in \[0, 8\), got {bad}"):
            m.pages_obtainable(keep=[bad])
    assert (m.stats(), m.allocator.free_pages().tolist(), dict(m.prefix.page_of)) == before
    assert m.attach("a", record).shape == (3,) and m.seq_len("a") == 9
    m.check()


def test_freeing_a_sequence_being_prefetched_waits_for_it_and_leaves_nothing_behind():
    t = _with_one_swapped()
    hot_free = t.manager.allocator.num_free
    t.prefetch(["s"])
    t.free("s")                                    # while (or after) its pages come back
    assert "s" not in t.manager and not t.is_swapped("s")
    assert t.tier.allocator.num_free == t.tier.num_pages      # its tier pages went back
    assert t.manager.allocator.num_free == hot_free           # and its hot pages
    t.manager.check()
    t.tier.allocator.check()


class _TierEngine:
    """An engine over a TieredKVCache whose KV is checkable: every token's K and V hold a value
    made from the tokens up to it (its prefix) and its sequence's cache salt (two salts: as with
    two LoRA adapters), so shared, cached, copied, spilled and swapped pages must all hold exactly
    what a sequence's own prefix gives."""

    def __init__(self, rng, *, spill):
        self.rng = rng
        self.t = tiered(hot_pages=14, tier_pages=40, max_seqs=8, spill=spill)
        self.m = self.t.manager
        self.tokens = {}   # seq_id -> its tokens (hot or swapped)
        self.salts = {}    # seq_id -> its cache salt
        self.next_id = 0
        self.prompts = [[int(x) for x in rng.integers(0, 5, 9)] for _ in range(2)]  # shared heads

    @staticmethod
    def value(prefix, salt):
        h = 0 if salt is None else 7
        for token in prefix:
            h = (h * 31 + token + 1) % 1_000_003
        return float(h)

    def step(self, seq_id, start):
        """One forward: the step's copies, then the KV of ``seq_id``'s tokens from ``start``."""
        src, dst = self.m.take_pending_copies()
        data = self.t.cache.data
        data[:, :, dst] = data[:, :, src]
        tokens = self.tokens[seq_id]
        table = self.m.page_table(seq_id)
        ps = self.m.page_size
        for p in range(start, len(tokens)):
            value = self.value(tokens[:p + 1], self.salts[seq_id])
            data[:, 0, table[p // ps], :, p % ps] = value
            data[:, 1, table[p // ps], :, p % ps] = -value

    def step_fails(self):
        """A forward that runs the step's copies and fails before writing any KV."""
        src, dst = self.m.take_pending_copies()
        self.t.cache.data[:, :, dst] = self.t.cache.data[:, :, src]

    def check(self, seq_id):
        tokens = self.tokens[seq_id]
        table = self.m.page_table(seq_id)
        ps = self.m.page_size
        positions = np.arange(len(tokens))
        got = self.t.cache.data[:, 0, table[positions // ps], 0, positions % ps, 0]  # [layers, tokens]
        want = [self.value(tokens[:p + 1], self.salts[seq_id]) for p in positions]
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape), err_msg=str(seq_id))
        got_v = self.t.cache.data[:, 1, table[positions // ps], -1, positions % ps, -1]
        np.testing.assert_array_equal(got_v, -got)

    def at_rest(self):
        return [s for s in self.tokens if s in self.m and self.t.is_ready(s)]

    def swapped(self):
        return [s for s in self.tokens if self.t.is_swapped(s)]

    def act(self):
        rng, m, t = self.rng, self.m, self.t
        action = rng.choice(["add", "add", "decode", "fork", "truncate", "swap_out", "swap_out",
                             "prefetch", "prefetch", "free", "clear", "wait", "failed_add",
                             "failed_decode"])
        rest = self.at_rest()
        try:
            if action == "add":
                head = self.prompts[rng.integers(len(self.prompts))][:rng.integers(4, 10)]
                tokens = head + [int(x) for x in rng.integers(0, 5, rng.integers(1, 7))]
                seq_id = self.next_id
                self.next_id += 1
                salt = [None, "adapter"][rng.integers(2)]
                cached = t.add_sequence(seq_id, tokens, cache_salt=salt)
                self.tokens[seq_id], self.salts[seq_id] = tokens, salt
                self.step(seq_id, cached)
            elif action == "decode" and rest:
                seq_id = rest[rng.integers(len(rest))]
                token = int(rng.integers(0, 5))
                m.append_tokens([seq_id], [token])
                self.tokens[seq_id].append(token)
                self.step(seq_id, len(self.tokens[seq_id]) - 1)
            elif action == "failed_add":  # its forward fails: freed, whatever it found cached
                head = self.prompts[rng.integers(len(self.prompts))][:rng.integers(4, 10)]
                t.add_sequence(self.next_id, head + [int(rng.integers(0, 5))],
                               cache_salt=[None, "adapter"][rng.integers(2)])
                self.step_fails()
                m.discard(self.next_id, 0)
                self.next_id += 1
            elif action == "failed_decode" and rest:
                seq_id = rest[rng.integers(len(rest))]
                m.append_tokens([seq_id], [int(rng.integers(0, 5))])
                self.step_fails()
                m.discard(seq_id, len(self.tokens[seq_id]))
            elif action == "fork" and rest:
                src = rest[rng.integers(len(rest))]
                m.fork(src, self.next_id)
                self.tokens[self.next_id] = list(self.tokens[src])
                self.salts[self.next_id] = self.salts[src]
                self.next_id += 1
            elif action == "truncate" and rest:
                seq_id = rest[rng.integers(len(rest))]
                keep = int(rng.integers(1, len(self.tokens[seq_id]) + 1))
                m.truncate(seq_id, keep)
                del self.tokens[seq_id][keep:]
            elif action == "swap_out" and rest:
                picked = rng.choice(rest, size=min(len(rest), int(rng.integers(1, 3))), replace=False)
                t.swap_out([int(s) for s in picked])
            elif action == "prefetch" and self.swapped():
                swapped = self.swapped()
                picked = rng.choice(swapped, size=min(len(swapped), int(rng.integers(1, 3))), replace=False)
                t.prefetch([int(s) for s in picked])
            elif action == "free" and self.tokens:
                seq_id = list(self.tokens)[rng.integers(len(self.tokens))]
                t.free(seq_id)
                del self.tokens[seq_id]
            elif action == "clear":
                m.clear_prefix_cache()
            elif action == "wait":
                t.wait()
        except (OutOfPagesError, ValueError) as exc:  # no room: refused, nothing changed
            assert "expected" in str(exc) or isinstance(exc, OutOfPagesError)
        for seq_id in self.at_rest():
            self.check(seq_id)
        t.check()


@pytest.mark.parametrize("spill", ["none", "all", "reused"])
def test_random_work_on_a_tiered_cache_keeps_every_sequences_kv(spill):
    """Adds on shared prompts, decode steps, forks, rollbacks, swaps both ways (some prefetches
    still running while other work goes on), frees and cache clears on a small hot pool (so the
    prefix cache evicts, and spills): after every action each sequence at rest reads exactly its
    own KV."""
    rng = np.random.default_rng(40 + ["none", "all", "reused"].index(spill))
    for _ in range(30):
        engine = _TierEngine(rng, spill=spill)
        for _ in range(60):
            engine.act()
        engine.t.wait()
        for seq_id in engine.at_rest():
            engine.check(seq_id)
        for seq_id in list(engine.tokens):
            engine.t.free(seq_id)
        engine.t.check()  # the tier now holds only spilled prefixes, one reference each
        assert engine.t.tier.allocator.num_used == len(engine.t.tier.prefixes)
