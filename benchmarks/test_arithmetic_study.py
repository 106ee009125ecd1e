"""arithmetic_study.py: its grouped shapes and its table say what they claim."""

import pytest

from arithmetic_study import grouped, main, no_overlap_share
from attention_cases import SHAPES, problem


def test_a_grouped_shape_keeps_the_caches_and_changes_only_the_query_heads():
    name = grouped("tiny", 3)
    assert SHAPES[name] == dict(SHAPES["tiny"], num_q_heads=3 * SHAPES["tiny"]["num_kv_heads"])
    base, three = problem("tiny", "float32"), problem(name, "float32")
    assert three.q.shape[1] == 3 * base.k_cache.shape[1]
    assert three.k_cache.shape == base.k_cache.shape and three.kv_bytes == base.kv_bytes


@pytest.mark.parametrize("from_cache, share", [(1.0, 0.5), (3.0, 0.75), (0.25, 0.2)])
def test_no_overlap_share_is_time_added_up(from_cache, share):
    # roof 1: memory takes 1 unit per byte, arithmetic 1/from_cache; the rate is 1 / (sum)
    assert no_overlap_share(from_cache) == pytest.approx(share)
    assert no_overlap_share(from_cache) == pytest.approx(1 / (1 + 1 / from_cache))


def test_the_table_has_a_row_per_kind_and_group(capsys):
    main(["--shape", "tiny", "--kinds", "float32", "bfloat16", "--groups", "1", "2", "--rounds", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| float32 |")
            or line.startswith("| bfloat16 |")]
    assert [row.split("|")[1:3] for row in rows] == [
        [" float32 ", " 1 "], [" float32 ", " 2 "], [" bfloat16 ", " 1 "], [" bfloat16 ", " 2 "]]
    for row in rows:  # numbers only (the tiny shape's shares are per-call overheads, near 0)
        cached, random, consecutive, no_overlap = (float(c.strip(" %")) for c in row.split("|")[3:7])
        assert cached >= 0 and random >= 0 and consecutive >= 0
        assert no_overlap == pytest.approx(100 * no_overlap_share(cached), abs=1.01)
