"""paired_times: the order of the calls it makes (no timing is asserted)."""

from paired import paired_times


def test_rounds_alternate_order_and_call_before_each_ahead_of_every_run():
    calls = []
    first, second = paired_times(lambda: calls.append("a"), lambda: calls.append("b"), 3,
                                 before_each=lambda: calls.append("evict"))
    assert calls == ["evict", "a", "evict", "b", "evict", "b", "evict", "a", "evict", "a", "evict", "b"]
    assert first.shape == second.shape == (3,)


def test_without_before_each_only_the_runs_are_called():
    calls = []
    paired_times(lambda: calls.append("a"), lambda: calls.append("b"), 2)
    assert calls == ["a", "b", "b", "a"]
