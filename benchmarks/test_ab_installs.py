"""ab_installs times two installs against each other: run here with the installed pagekv on both sides."""

import math
import os

import pytest

import ab_installs
import pagekv

SITE = os.path.dirname(os.path.dirname(os.path.abspath(pagekv.__file__)))


def rows(out, shape):
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith(f"| {shape} |")]


# decode in both dtypes; the other modes in float32 only (each prefill configuration compiles for
# a minute on a busy two-core machine, twice: both workers compile it side by side)
@pytest.mark.parametrize("mode, kinds", [([], ["float32", "bfloat16"]), (["--from-cache"], ["float32"]),
                                         (["--prefill", "17"], ["float32"])])
def test_one_row_per_case_with_a_ratio_from_both_workers(capsys, mode, kinds):
    ab_installs.main([SITE, "--new-site", SITE, "--shapes", "tiny", "--kinds", *kinds, "--rounds", "3",
                      *mode])
    out = capsys.readouterr().out
    pagekv_dir = os.path.dirname(os.path.abspath(pagekv.__file__))
    assert f"old: {pagekv_dir}\nnew: {pagekv_dir}\n" in out  # each worker says which pagekv it timed
    table = rows(out, "tiny")
    assert [row[1] for row in table] == kinds
    for _, _, median, spread in table:
        low, high = map(float, spread.split("-"))
        assert 0 < low <= float(median) <= high < math.inf


def test_a_folder_without_pagekv_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_installs.main([str(tmp_path)])
    assert f"expected a folder holding a pagekv package, got '{tmp_path}'" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--prefill", "0"], "expected --prefill a positive number of tokens, got 0"),
    (["--prefill", "--from-cache"], "expected --from-cache or --prefill, got both"),
])
def test_contradictory_options_are_refused(capsys, options, message):
    with pytest.raises(SystemExit):
        ab_installs.main([SITE, *options])
    assert message in capsys.readouterr().err
