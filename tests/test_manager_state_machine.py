"""A Hypothesis state machine runs KVCacheManager and its plain-Python twin side by side.

Tokens come from a small alphabet and prompts often extend earlier ones, so prefix hits, forks of
shared pages, copy-on-write and eviction all happen. After every step both must agree on every
answer and on every page table up to a renaming of page ids, and the invariants must hold.

The machine also plays the engine on the manager's pages, as its contract says: a forward runs the
queued copies (in parallel: no page may be both a source and a destination) and then writes the
token of every slot handed out since, and a sequence is forked, truncated, freed or detached only
once its slots are written; a detach reads a page that waits for its copy from the copy's source,
and an attach writes its KV into its fresh pages at once, as a second tier does. Copies may stay
queued across many calls meanwhile. After each forward every sequence must read back its own tokens.
Prompts come under a few cache salts, and a token's KV is tagged with its sequence's salt: a page
shared across salts would read back another salt's KV.
"""

from functools import partial

import numpy as np

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule)

from pagekv import KVCacheManager
from pagekv.errors import PagekvError
from pagekv.reference.manager import ReferenceKVCacheManager, root_key

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=14)
SALTS = [None, b"adapter-a", "tenant-b"]
SALT_TAG = {root_key(salt): 1000 * tag for tag, salt in enumerate(SALTS)}  # KV = token + tag
SALT_OF = {root_key(salt): salt for salt in SALTS}


def shared_layout(tables):
    """Each table's pages as indices of the distinct pages in order of first use: the sharing a
    group's tables have, whatever the page ids."""
    index = {}
    return [[index.setdefault(int(page), len(index)) for page in table] for table in tables]


def outcome(fn, *args):
    try:
        value = fn(*args)
    except (PagekvError, ValueError, TypeError) as exc:
        return ("error", type(exc).__name__)
    if value is None or isinstance(value, int):
        return ("ok", value)
    if isinstance(value, tuple):  # attach's (pages, fresh) with reuse_cached
        return ("ok", ([int(x) for x in value[0]], [bool(x) for x in value[1]]))
    return ("ok", [int(x) for x in value])


class ManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(num_pages=st.integers(2, 24), page_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans())
    def start(self, num_pages, page_size, caching):
        options = dict(num_pages=num_pages, page_size=page_size, max_seqs=6, max_pages_per_seq=8,
                       enable_prefix_caching=caching)
        self.fast = KVCacheManager(**options)
        self.twin = ReferenceKVCacheManager(**options)
        self.prompts = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
        self.next_id = 0
        self.last_slots = None
        self.detached = []  # (seq_id, fast record, twin record, its KV) of detached sequences
        self.groups = []  # (seq_ids, fast records, twin records, shared layout, their KV) detached together
        self.kv = np.full(num_pages * page_size, -1, np.int64)  # the token each of fast's slots holds
        self.unwritten = {}  # seq_id -> [(slot, token), ...] handed out and not written yet
        self.added = set()  # sequences added since the last forward

    # ------------------------------------------------------------------ the engine's KV
    def forward(self):
        """Run the queued copies, write every unwritten slot, and read every sequence back."""
        self.run_copies()
        for writes in self.unwritten.values():
            for slot, token in writes:
                self.kv[slot] = token
        self.unwritten, self.added = {}, set()
        for seq_id, tokens in self.twin.tokens.items():
            tag = SALT_TAG[self.twin.roots[seq_id]]
            assert self.kv[self.slots(seq_id)].tolist() == [t + tag for t in tokens], \
                f"sequence {seq_id} reads other KV"

    def run_copies(self):
        """Take the queued copies (the same in fast and twin, up to the renaming) and run them as
        copy_pages does, all at once: no page may be both a source and a destination."""
        src, dst = self.fast.take_pending_copies()
        expected = self.twin.take_pending_copies()
        rename = self.renaming()
        for (s, d), (ts, td) in zip(zip(src.tolist(), dst.tolist()), expected):
            assert rename.setdefault(s, ts) == ts and rename.setdefault(d, td) == td, "copies differ"
        assert len(src) == len(expected) and len(set(rename.values())) == len(rename)
        assert set(src.tolist()).isdisjoint(dst.tolist()) and len(set(dst.tolist())) == len(dst)
        ps = self.fast.page_size
        pages = self.kv.reshape(-1, ps)
        pages[dst] = pages[src]

    def settle(self, seq_id):
        """The contract: a sequence with slots handed out is forked, truncated, freed or detached
        only after a forward has written them."""
        if self.unwritten.get(seq_id):
            self.forward()

    def slots(self, seq_id, start=0):
        table = self.fast.page_table(seq_id)
        positions = np.arange(start, self.fast.seq_len(seq_id))
        return table[positions // self.fast.page_size] * self.fast.page_size + positions % self.fast.page_size

    def handed_out(self, seq_id, slots, tokens):
        """Slots to write at the next forward; until then they hold no token (-9: whatever a
        fresh page holds), so reading one before its write shows."""
        tag = SALT_TAG[self.twin.roots[seq_id]]
        self.unwritten.setdefault(seq_id, []).extend((slot, token + tag) for slot, token in zip(slots, tokens))
        self.kv[slots] = -9

    def kv_now(self, seq_id):
        """The KV of ``seq_id`` as a tier's swap-out reads it between steps: a page waiting for
        its queued copy from the copy's source (fast and twin name the same sources)."""
        table = self.fast.page_table(seq_id)
        sources = self.fast.kv_sources(table)
        rename = self.renaming()
        for f, t in zip(sources.tolist(), self.twin.kv_sources(self.twin.tables[seq_id])):
            assert rename.setdefault(f, t) == t, "kv_sources differ"
        ps = self.fast.page_size
        positions = np.arange(self.fast.seq_len(seq_id))
        return self.kv[sources[positions // ps].astype(np.int64) * ps + positions % ps]

    def attach_kv(self, seq_ids, kvs, got):
        """A tier's swap-in: the KV is written at once into the fresh pages (with reuse_cached, not
        into the cached pages reused, which must hold it already)."""
        pages, fresh = got if isinstance(got, tuple) else (got, [True] * len(got))
        written = {page for page, new in zip(pages, fresh) if new}
        for seq_id, kv in zip(seq_ids, kvs):
            slots = self.slots(seq_id)
            mine = np.isin(slots // self.fast.page_size, list(written))
            self.kv[slots[mine]] = kv[mine]

    def both(self, name, *args, **options):
        got = outcome(partial(getattr(self.fast, name), **options), *args)
        expected = outcome(partial(getattr(self.twin, name), **options), *args)
        assert got[0] == expected[0], f"{name}{args}: fast {got} != twin {expected}"
        if got[0] == "error" or got[1] is None or isinstance(got[1], int):
            assert got == expected, f"{name}{args}: fast {got} != twin {expected}"
        else:
            self.last_slots = (name, got[1], expected[1])  # slots: compared under the page renaming
        self.value = got[1]  # fast's answer
        return got[0] == "ok"

    @rule(target=seqs, data=st.data())
    def add(self, data):
        base = data.draw(st.sampled_from(self.prompts))
        prompt = base[:data.draw(st.integers(0, len(base)))] + data.draw(TOKENS)
        return self.add_prompt(prompt, data.draw(st.sampled_from(SALTS)))

    def add_prompt(self, prompt, salt):
        seq_id = self.next_id
        self.next_id += 1
        if self.both("add_sequence", seq_id, prompt, cache_salt=salt):
            self.prompts.append(prompt)
            cached = self.value
            self.handed_out(seq_id, self.slots(seq_id, cached).tolist(), prompt[cached:])
            self.added.add(seq_id)
            return seq_id
        return -1  # refused (no pages or rows): later rules see an unknown id

    @rule(seq=seqs, tokens=TOKENS)
    def append(self, seq, tokens):
        if self.both("append", seq, tokens):
            self.handed_out(seq, self.value, tokens)

    @rule(data=st.data())
    def decode_step(self, data):
        live = sorted(self.twin.tables)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        tokens = data.draw(st.lists(st.integers(0, 3), min_size=len(chosen), max_size=len(chosen)))
        if self.both("append_tokens", chosen, tokens):
            for seq_id, slot, token in zip(chosen, self.value, tokens):
                self.handed_out(seq_id, [slot], [token])

    @rule()
    def run_forward(self):
        self.forward()

    @rule()
    def failed_forward(self):
        """A forward that raised before writing, taken back as the transformers integration does:
        each sequence keeps the tokens whose KV is written (discard), those it added are freed."""
        for seq_id, writes in self.unwritten.items():
            self.both("discard", seq_id, self.twin.seq_len(seq_id) - len(writes))
            if seq_id in self.added and seq_id in self.twin.tables:
                self.both("free", seq_id)
        self.unwritten, self.added = {}, set()

    @rule(seq=seqs, data=st.data())
    def truncate(self, seq, data):
        """Roll back to a prefix (speculative decoding's rejected drafts); 0 and past the end are refused."""
        length = self.twin.seq_len(seq) if seq in self.twin.tables else 2
        self.settle(seq)
        self.both("truncate", seq, data.draw(st.integers(0, length + 1)))

    @rule(target=seqs, src=seqs)
    def fork(self, src):
        dst = self.next_id
        self.next_id += 1
        self.settle(src)
        return dst if self.both("fork", src, dst) else -1

    @rule(target=seqs, src=consumes(seqs), token=st.integers(0, 3))
    def branch_and_drop(self, src, token):
        """A fork appended to (its shared partial page copied: a queued copy) and its source freed
        before the copies run: the copy's source has no table left, only the copy's reference."""
        dst = self.fork(src)
        if dst != -1:
            self.append(dst, [token])
            self.both("free", src)
        return dst

    @rule(seq=consumes(seqs))
    def free(self, seq):
        self.settle(seq)
        self.both("free", seq)

    @rule(seq=consumes(seqs))
    def detach(self, seq):
        """Swap-out bookkeeping: the sequence leaves its pages and keeps a record of itself."""
        self.settle(seq)
        kv = self.kv_now(seq) if seq in self.twin.tables else None
        records = []
        for manager in (self.fast, self.twin):
            try:
                records.append(manager.detach(seq))
            except PagekvError as exc:
                records.append(type(exc).__name__)
        assert isinstance(records[0], str) == isinstance(records[1], str), f"detach({seq}): {records}"
        if not isinstance(records[0], str):
            self.detached.append((seq, *records, kv))

    @rule(target=seqs, data=st.data(), reuse=st.booleans())
    def attach(self, data, reuse):
        if not self.detached:
            return -1
        index = data.draw(st.integers(0, len(self.detached) - 1))
        seq, fast_record, twin_record, kv = self.detached[index]
        got = outcome(partial(self.fast.attach, reuse_cached=reuse), seq, fast_record)
        expected = outcome(partial(self.twin.attach, reuse_cached=reuse), seq, twin_record)
        if not self.same_attach(got, expected, reuse):
            return -1
        del self.detached[index]
        self.attach_kv([seq], [kv], got[1])
        return seq

    def same_attach(self, got, expected, reuse):
        """Both attached or both refused alike; with reuse, the same pages reused. False if refused
        (nothing changed: the record stays for a later try)."""
        assert got[0] == expected[0], f"attach: fast {got} != twin {expected}"
        if got[0] == "error":
            assert got == expected
            return False
        if reuse:
            assert got[1][1] == expected[1][1], "attach reused other pages"
        return True

    @rule(data=st.data())
    def same_prompt_beside_a_swap_in(self, data):
        """A detached sequence's prompt comes again (its cached pages perhaps cleared meanwhile:
        then they are handed out afresh) and the sequence is attached with reuse in the same step,
        whose forward runs or fails. A page only that forward was to write is not reused."""
        if not self.detached or not self.twin.caching:
            return
        _, _, twin_record, _ = self.detached[data.draw(st.integers(0, len(self.detached) - 1))]
        if data.draw(st.booleans()):
            self.clear()
        self.add_prompt(list(twin_record[0]), SALT_OF[twin_record[2]])
        self.attach(data, True)
        if data.draw(st.booleans()):
            self.failed_forward()
        else:
            self.forward()

    @rule(data=st.data())
    def detach_group(self, data):
        """Swap-out of a group (forks, parallel samples): detached together, with the sharing of
        their pages kept for attach_shared."""
        live = sorted(self.twin.tables)
        if not live:
            return
        first = data.draw(st.sampled_from(live))
        pages = set(self.twin.tables[first])
        sharers = [seq for seq in live if seq != first and pages & set(self.twin.tables[seq])]
        others = sharers or [seq for seq in live if seq != first]
        group = [first] + (data.draw(st.lists(st.sampled_from(others), max_size=2, unique=True))
                           if others else [])
        for seq in group:
            self.settle(seq)
        layout = shared_layout([self.fast.page_table(seq) for seq in group])
        assert layout == shared_layout([self.twin.tables[seq] for seq in group])
        kvs = [self.kv_now(seq) for seq in group]
        fast = [self.fast.detach(seq) for seq in group]
        twin = [self.twin.detach(seq) for seq in group]
        self.groups.append((group, fast, twin, layout, kvs))

    @rule(target=seqs, data=st.data(), reuse=st.booleans())
    def attach_group(self, data, reuse):
        if not self.groups:
            return multiple()
        index = data.draw(st.integers(0, len(self.groups) - 1))
        group, fast, twin, layout, kvs = self.groups[index]
        got = outcome(partial(self.fast.attach_shared, reuse_cached=reuse), group, fast, layout)
        expected = outcome(partial(self.twin.attach_shared, reuse_cached=reuse), group, twin, layout)
        if not self.same_attach(got, expected, reuse):
            return multiple()
        del self.groups[index]
        self.attach_kv(group, kvs, got[1])
        return multiple(*group)

    @rule()
    def clear(self):
        self.both("clear_prefix_cache")

    @rule(seq=seqs)
    def unknown_or_known_length(self, seq):
        self.both("seq_len", seq)

    def renaming(self):
        """fast page id -> twin page id, from the tables and the cache, which must agree on it."""
        rename = {}

        def same_page(fast_page, twin_page):
            assert rename.setdefault(int(fast_page), twin_page) == twin_page, "page renaming broke"

        assert sorted(self.fast.seq_ids()) == sorted(self.twin.tables)
        for seq_id, table in self.twin.tables.items():
            fast_table = self.fast.page_table(seq_id)
            assert len(fast_table) == len(table) and self.fast.seq_len(seq_id) == self.twin.seq_len(seq_id)
            for f, t in zip(fast_table, table):
                same_page(f, t)
        if self.fast.prefix is not None:
            assert self.fast.prefix.page_of.keys() == self.twin.page_of.keys()
            for key, page in self.twin.page_of.items():
                same_page(self.fast.prefix.page_of[key], page)
            assert [rename[p] for p in self.fast.prefix.evictable] == self.twin.lru
        assert len(set(rename.values())) == len(rename), "two fast pages map to one twin page"
        return rename

    @invariant()
    def same_tables_up_to_renaming(self):
        if not hasattr(self, "fast"):
            return
        rename = self.renaming()
        if self.last_slots:
            name, fast_slots, twin_slots = self.last_slots
            ps = self.fast.page_size
            assert [rename[s // ps] * ps + s % ps for s in fast_slots] == twin_slots, name
            self.last_slots = None

    @invariant()
    def invariants_and_stats(self):
        if not hasattr(self, "fast"):
            return
        self.fast.check()
        self.twin.allocator.check()
        assert self.fast.stats().__dict__ == self.twin.stats()
        free = set(self.fast.allocator.free_pages().tolist())
        for seq_id in self.twin.tables:
            assert free.isdisjoint(self.fast.page_table(seq_id).tolist())

    def teardown(self):
        if not hasattr(self, "fast"):
            return
        for seq_id in list(self.twin.tables):
            self.fast.free(seq_id)
        self.fast.clear_prefix_cache()
        assert not len(self.fast.take_pending_copies()[0]), "a copy into a freed page stayed queued"
        assert self.fast.allocator.num_free == self.fast.allocator.num_pages, "a page leaked"
        self.fast.check()


TestManagerMachine = ManagerMachine.TestCase
# 1000 examples (~20 s): at 200 the machine missed, and at 1000 (derandomized, as in CI) it finds,
# both a queued copy's source handed out before the copy ran and a failed forward's pages left cached;
# with same_prompt_beside_a_swap_in it finds an attach reusing a page only a failed forward was to
# write in each of three runs (without that rule, CI's run found it once and 12,000 examples here not).
TestManagerMachine.settings = settings(max_examples=1000, stateful_step_count=40)
