"""page_runs.py's helpers: run statistics and the comparison layouts say what they claim."""

import numpy as np

from page_runs import as_block_table, churn_tables, consecutive_tables, random_tables, run_stats


def test_run_stats_by_hand():
    tables = [np.array([4, 5, 6, 9], np.int32), np.array([1, 2], np.int32), np.array([7], np.int32)]
    share, run = run_stats(tables)
    assert share == 3 / 4  # steps: +1 +1 +3, +1
    assert run == (3 * 3 + 1 + 2 * 2 + 1) / 7  # runs 3, 1, 2, 1 (page-weighted)


def test_layouts_keep_each_sequence_length_on_distinct_pages():
    tables = [np.array([9, 3, 4], np.int32), np.array([0], np.int32), np.array([7, 8], np.int32)]
    consecutive = consecutive_tables(tables)
    assert [t.tolist() for t in consecutive] == [[0, 1, 2], [3], [4, 5]]
    shuffled = random_tables(tables, 12, np.random.default_rng(0))
    assert [len(t) for t in shuffled] == [3, 1, 2]
    assert len(set(np.concatenate(shuffled).tolist())) == 6 and max(map(max, shuffled)) < 12
    assert as_block_table(tables).tolist() == [[9, 3, 4], [0, 0, 0], [7, 8, 0]]


def test_churn_leaves_live_tables_that_cover_their_lengths():
    tables, lens, num_pages = churn_tables(live=4, steps=300, page_size=4, prompt_tokens=(3, 30),
                                           new_tokens=(5, 60))
    assert len(tables) == len(lens) == 4
    assert [len(t) for t in tables] == [-(-int(n) // 4) for n in lens]
    pages = np.concatenate(tables)
    assert len(set(pages.tolist())) == len(pages) and pages.max() < num_pages
