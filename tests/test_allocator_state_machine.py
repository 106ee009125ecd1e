"""A Hypothesis state machine runs PageAllocator and its plain-Python twin side by side.

Every rule performs one operation, valid or not, on both; afterwards both must agree on the result
(identical page ids: the policy is part of the contract) or on the error, and on the whole state.
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagekv import PageAllocator
from pagekv.errors import PagekvError
from pagekv.reference import ReferencePageAllocator

POOL_SIZES = st.sampled_from([1, 2, 7, 63, 64, 65, 127, 129])


def outcome(fn, *args, **kwargs):
    """('ok', value as lists) or ('error', the exception's class name)."""
    try:
        value = fn(*args, **kwargs)
    except (PagekvError, ValueError, TypeError) as exc:
        return ("error", type(exc).__name__)
    if isinstance(value, tuple):
        return ("ok", tuple(np.asarray(v).tolist() for v in value))
    return ("ok", None if value is None else np.asarray(value).tolist())


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_pages=POOL_SIZES)
    def start(self, num_pages):
        self.fast = PageAllocator(num_pages)
        self.twin = ReferencePageAllocator(num_pages)

    def both(self, name, *args, **kwargs):
        got = outcome(getattr(self.fast, name), *args, **kwargs)
        expected = outcome(getattr(self.twin, name), *args, **kwargs)
        assert got == expected, f"{name}{args}{kwargs}: fast {got} != twin {expected}"
        return got

    def after(self, data):
        """A page to grow after: None, -1, mostly a used page (a sequence's last), or out of range."""
        n = self.twin.num_pages
        used = sorted(self.twin.refcounts)
        choices = [st.none(), st.integers(-2, n)] + ([st.sampled_from(used)] * 3 if used else [])
        return data.draw(st.one_of(*choices))

    def page_ids(self, data, *, allow_invalid):
        """A batch drawn mostly from used pages, sometimes with free or out-of-range ids."""
        used = sorted(self.twin.refcounts)
        choices = st.sampled_from(used) if used else st.nothing()
        if allow_invalid or not used:
            choices = st.one_of(choices, st.integers(-2, self.twin.num_pages + 1))
        return data.draw(st.lists(choices, max_size=12))

    @rule(n=st.integers(-1, 70), data=st.data())
    def allocate(self, n, data):
        self.both("allocate", n, after=self.after(data))

    @rule(counts=st.lists(st.integers(-1, 20), max_size=6), data=st.data())
    def allocate_many(self, counts, data):
        after = None
        if data.draw(st.booleans()):
            after = [self.after(data) for _ in counts]
            after = [-1 if a is None else a for a in after]
        if after is not None and data.draw(st.booleans()):
            after = after + [-1]  # one too many: a shape error, nothing taken
        self.both("allocate_many", counts, after=after)

    @precondition(lambda self: self.twin.num_free > 0)
    @rule(data=st.data())
    def allocate_one(self, data):
        after = self.after(data)
        if after is not None and not -1 <= after < self.twin.num_pages:
            after = None
        assert self.fast.allocate_one(after=after) == self.twin.allocate(1, after=after)[0]

    @rule(length=st.integers(1, 6), data=st.data())
    def grow_side_by_side(self, length, data):
        """Sequences growing a page at a time in turn, each after its own last page: the decode
        pattern that runs are for."""
        lasts = [None, None]
        for _ in range(length):
            for i in range(2):
                if self.twin.num_free == 0:
                    return
                got = self.fast.allocate_one(after=lasts[i])
                assert got == self.twin.allocate(1, after=lasts[i])[0]
                lasts[i] = got

    @rule(data=st.data(), allow_invalid=st.booleans())
    def incref(self, data, allow_invalid):
        self.both("incref", self.page_ids(data, allow_invalid=allow_invalid))

    @rule(data=st.data(), allow_invalid=st.booleans())
    def decref(self, data, allow_invalid):
        self.both("decref", self.page_ids(data, allow_invalid=allow_invalid))

    @rule(data=st.data())
    def decref_everything_once(self, data):
        # Releasing every holder's reference: the shape of freeing all sequences at once.
        pages = [p for p, count in self.twin.refcounts.items() for _ in range(count)]
        self.both("decref", data.draw(st.permutations(pages)))

    @rule(data=st.data(), n=st.integers(-1, 70))
    def queries(self, data, n):
        ids = self.page_ids(data, allow_invalid=True)
        self.both("refcount", ids)
        self.both("is_free", ids)
        self.both("can_allocate", n)

    @invariant()
    def same_state(self):
        assert self.fast.free_pages().tolist() == self.twin.free_stack[::-1]
        everything = np.arange(self.twin.num_pages)
        assert self.fast.refcount(everything).tolist() == self.twin.refcount(everything)
        assert (self.fast.num_free, self.fast.num_used) == (self.twin.num_free, self.twin.num_used)

    @invariant()
    def invariants_hold(self):
        self.fast.check()
        self.twin.check()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=60)
