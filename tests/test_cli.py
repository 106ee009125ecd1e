"""The `pagekv` command end to end: every subcommand, bad flags, a malformed trace, and the
simulator's contiguous policy against a hand computation."""

import json
import os
import re
import subprocess
import sys

import llvmlite.binding as llvm  # type: ignore[import-untyped]
import numpy as np
import pytest

from pagekv.cli import main
from pagekv.models import ModelShape
from pagekv.sim import CostModel, SimConfig, simulate
from pagekv.trace import Request, default_trace


def test_simulate_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    assert main(["simulate", "--limit", "25", "--memory", "4GiB", "--no-progress",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    table = capsys.readouterr().out
    assert "contiguous" in table and "paged+prefix" in table
    data = json.loads(out_json.read_text())
    assert [r["policy"] for r in data["results"]] == ["contiguous", "paged", "paged+prefix", "paged+swap"]
    for r in data["results"]:
        assert r["completed"] + r["rejected"] == 25
        assert 0 < r["peak_memory_fraction"] <= 1.0
    assert out_png.read_bytes().startswith(b"\x89PNG")


def test_paged_policies_stay_in_budget_and_free_every_page():
    requests = default_trace()[:40]
    config = SimConfig(model=ModelShape("tiny", 4, 2, 64, 1e8), memory_bytes=300 * 2**20)
    for policy in ("paged", "paged+prefix", "paged+swap"):
        result = simulate(requests, config, policy)  # raises if a page leaked or a check failed
        assert result.peak_memory_fraction <= 1.0
        assert result.completed + result.rejected == 40


def test_simulate_with_attention_and_synthetic_trace(capsys):
    assert main(["simulate", "--synthetic", "--num-requests", "12", "--rate", "50",
                 "--memory", "1GiB", "--policies", "paged", "--attention", "--no-progress"]) == 0
    assert "decode kernel (paged, one layer, real pages)" in capsys.readouterr().out


def test_simulate_with_spilled_prefixes_reports_them(capsys):
    """--spill-prefixes: a 1 GiB hot cache evicts the synthetic system prompts, which later
    requests find in host memory."""
    assert main(["simulate", "--synthetic", "--num-requests", "40", "--rate", "20", "--memory", "1GiB",
                 "--policies", "paged+swap", "--spill-prefixes", "all", "--no-progress"]) == 0
    line = re.search(r"evicted prefix pages copied to host memory: ([0-9.]+) GiB; copied back for "
                     r"prompts that hit them: ([0-9.]+) GiB", capsys.readouterr().out)
    assert line and float(line[1]) > float(line[2]) > 0


def test_contiguous_policy_matches_a_hand_computation():
    # 8 bytes per token (1 layer, 1 KV head, head_dim 1, float32), pages of 10 tokens; every
    # non-empty step costs exactly 1 simulated second.
    model = ModelShape("toy", 1, 1, 1, 1.0)
    cost = CostModel(overhead_s=1.0, bandwidth_bytes_s=1e30, flops=1e30)
    requests = [Request(0.0, 10, 3, (1,)), Request(0.0, 10, 2, (2,))]

    def run(memory_bytes):
        config = SimConfig(model=model, memory_bytes=memory_bytes, page_size=10, dtype="float32",
                           max_new_tokens=40, cost=cost)
        return simulate(requests, config, "contiguous")

    both = run(800)  # 100 tokens: both reservations of 10 + 40 fit at once
    assert (both.completed, both.peak_running, both.simulated_seconds) == (2, 2, 3.0)
    assert both.mean_running == 1.0                         # 2, 1, 0 after the three steps
    assert both.mean_memory_fraction == pytest.approx(0.5)  # 100%, 50%, 0%
    assert both.mean_fragmentation_fraction == pytest.approx((78 + 38 + 0) / 300)
    assert (both.ttft_p50, both.latency_p50) == (1.0, 2.5)
    assert both.output_tokens_per_s == pytest.approx(5 / 3)
    one = run(720)   # 90 tokens: the second reservation waits for the first to end
    assert (one.completed, one.peak_running, one.simulated_seconds) == (2, 1, 5.0)
    assert one.latency_p99 == pytest.approx(5.0 - 0.02 * 1.0, abs=0.05)


def test_malformed_trace_names_the_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n'
                     '{"timestamp": 1, "input_length": "many"}\n')
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 2
    assert f"{trace}:2: expected a JSON object" in capsys.readouterr().err


def test_missing_trace_file(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "none.jsonl"), "--no-progress"]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_an_output_file_that_cannot_be_written_is_an_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    """The folder passed the check when the flags were read, then went away before the write."""
    folder = tmp_path / "out"
    folder.mkdir()
    from pagekv import commands
    dump = commands._dump_json
    monkeypatch.setattr(commands, "_dump_json", lambda path, data: (folder.rmdir(), dump(path, data)))
    assert main(["simulate", "--synthetic", "--num-requests", "3", "--json", str(folder / "x.json"),
                 "--no-progress"]) == 2
    assert f"cannot write {folder / 'x.json'}: No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--memory", "lots"], "expected a size like 16GiB"),
    (["simulate", "--page-size", "0"], "expected a positive integer, got '0'"),
    (["simulate", "--model", "gpt-9"], "invalid choice"),
    (["plan", "--context", "-4"], "expected a positive integer"),
    (["frobnicate"], "invalid choice"),
    (["simulate", "--synthetic", "--rate", "-1"], "expected a positive number, got '-1'"),
    (["simulate", "--synthetic", "--rate", "nan"], "expected a positive number, got 'nan'"),
    (["plan", "--params", "0"], "expected a positive number, got '0'"),
    (["simulate", "--json", "/no/such/folder/out.json"], "expected a file path in a writable folder"),
    (["simulate", "--plot", "."], "expected a file path in a writable folder, got '.'"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_computes_the_design_notes_example(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--memory", "80GiB", "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "327,680" in out                     # 2 x 80 x 8 x 128 x 2 bytes per token
    assert "40.00 GiB" in out                   # 131,072 tokens of it
    assert "paged             8 " in out        # 80 GiB / (32,768 x 327,680 B = 10 GiB)
    assert "contiguous        2 " in out        # 80 GiB / (131,072 x 327,680 B)
    assert main(["plan", "--model", "llama-3-70b", "--memory", "80GiB", "--context", "32768",
                 "--dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert "163,840" in out and "paged             16 " in out  # a byte per number: twice the sequences
    assert "contiguous        4 " in out


def test_info_and_bench(capsys, monkeypatch):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "numba" in out and "threads" in out and "cache" in out
    from pagekv import attention
    decode, caches = attention.paged_decode_attention, []
    monkeypatch.setattr(attention, "paged_decode_attention",
                        lambda q, k, v, *a, **kw: (caches.append((k, v)), decode(q, k, v, *a, **kw))[1])
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "streaming read" in out and "decode S1 bfloat16" in out and "ns per page" in out
    # K and V in one array read each page twice from cache and counted it twice: 139% of the roof
    s1 = [(k, v) for k, v in caches if k.shape[0] == 16 * 128]  # not warmup()'s tiny caches
    assert len(s1) >= 2 and not any(np.shares_memory(k, v) for k, v in s1)


@pytest.mark.parametrize("amx, products, amx_flag, env, expected", [
    (True, True, True, "1", "AMX tiles for prefill, and for decode with GQA groups of 2-16 query heads per "
                            "KV head (4-16 above head_dim 128); vdpbf16ps otherwise (PAGEKV_AMX=0 turns "
                            "AMX off)"),
    (False, True, True, "0", "vdpbf16ps (AVX512-BF16) products, float32 sums (AMX off: PAGEKV_AMX=0)"),
    (False, True, True, "1", "vdpbf16ps (AVX512-BF16) products, float32 sums (the CPU has AMX, but this OS "
                             "did not grant its tile state)"),
    (False, True, False, "1", "vdpbf16ps (AVX512-BF16) products, float32 sums"),
    (False, False, False, "1", "rows widened to float32 as they load (no AVX512-BF16)"),
])
def test_info_names_the_bfloat16_path(capsys, monkeypatch, amx, products, amx_flag, env, expected):
    """Which of the three bfloat16 paths this process takes, and why not AMX where the CPU has it,
    whatever the CPU running the test."""
    from pagekv import attention
    from pagekv.kernels import _amx
    monkeypatch.setenv("PAGEKV_AMX", env)
    monkeypatch.setattr(_amx, "AVAILABLE", amx)
    monkeypatch.setattr(attention, "BF16_PRODUCTS", products)
    features = llvm.get_host_cpu_features()
    features["amx-bf16"] = amx_flag
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: features)
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [row for row in lines if row.startswith("bfloat16")] == [f"bfloat16   {expected}"]


def test_info_finds_the_kernels_under_numba_cache_dir(tmp_path):
    """Numba files a NUMBA_CACHE_DIR cache in a subfolder named after the kernels' folder: info
    reports that folder and what it holds (it looked at the top and saw nothing)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    compile_one = ("import numpy as np; from pagekv.kernels.bandwidth import stream_sum; "
                   "stream_sum(np.ones(64, np.float32), 1)")
    subprocess.run([sys.executable, "-c", compile_one], check=True, cwd=tmp_path, env=env)
    out = subprocess.run([sys.executable, "-m", "pagekv.cli", "info"], check=True, cwd=tmp_path,
                         env=env, capture_output=True, text=True).stdout
    assert f"cache      {tmp_path}{os.sep}kernels_" in out
    assert "compiled   bandwidth" in out


def test_the_installed_command_explains_itself():
    result = subprocess.run([sys.executable, "-I", "-m", "pagekv.cli", "simulate", "--help"],
                            capture_output=True, text=True, check=True)
    assert "--trace FILE" in result.stdout and "contiguous" in result.stdout


def test_simulate_rejects_an_unknown_policy():
    config = SimConfig(model=ModelShape("tiny", 1, 1, 8, 1e6), memory_bytes=2**20)
    with pytest.raises(ValueError, match="expected a policy in"):
        simulate(default_trace()[:1], config, "magic")


def test_budget_below_one_page_is_refused(capsys):
    assert main(["simulate", "--memory", "1KiB", "--no-progress"]) == 2
    assert "expected a budget of at least one page" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--memory", "300TiB"], "expected --memory of at most 262144.00 GiB "
                             r"\(2,147,483,647 tokens of llama-3-8b's KV\), got 307200.00 GiB"),
    (["--page-size", "1", "--swap-memory", "300TiB"], "expected --swap-memory of at most"),
])
def test_budgets_past_what_int32_slots_address_are_refused(capsys, flags, message):
    assert main(["simulate", *flags, "--no-progress"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_huge_host_tier_is_no_concern_of_policies_without_it(capsys):
    assert main(["simulate", "--swap-memory", "300TiB", "--page-size", "1", "--limit", "2",
                 "--policies", "paged", "--no-progress"]) == 0


def _swap_run(*, spill="none", **cost):
    from pagekv.models import PRESETS
    from pagekv.trace import synthetic_trace

    requests = synthetic_trace(num_requests=200, rate=10.0, seed=0)
    config = SimConfig(model=PRESETS["llama-3-8b"], memory_bytes=4 * 2**30, cost=CostModel(**cost),
                       spill_prefixes=spill)
    return simulate(requests, config, "paged+swap"), simulate(requests, config, "paged+prefix")


def test_swap_preemption_moves_pages_both_ways_and_hides_its_swap_ins():
    swap, recompute = _swap_run()
    assert swap.completed + swap.rejected == 200  # and simulate() found no leaked page in either tier
    assert swap.swap_outs > 0 and swap.swap_outs <= swap.preemptions
    # every swapped sequence came back; full pages the prefix cache held stayed hot, and crossed
    # neither way unless evicted meanwhile (0.19 GiB each way when written; 1.82 GiB out and back
    # when every page crossed)
    assert 0 < swap.swap_in_bytes <= swap.swap_out_bytes
    assert swap.swap_in_hidden_fraction >= 0.8        # the target, issued one step ahead
    assert recompute.swap_outs == 0 and recompute.swap_out_bytes == 0


def test_spilled_prefixes_come_back_from_host_memory_as_hits():
    """The host tier as a second-level prefix cache: the 4 GiB hot cache evicts system prompts
    and conversation heads that later prompts find in host memory. Copying only the pages a prompt
    hit while hot gets nearly the hits of copying all of them, for far fewer copies."""
    every, recompute = _swap_run(spill="all")
    reused, _ = _swap_run(spill="reused")
    for spill in (every, reused):
        assert spill.completed + spill.rejected == 200  # and simulate() found no leaked page
        assert 0 < spill.restored_bytes <= spill.spilled_bytes
        assert spill.swap_outs == spill.preemptions > 0  # spilled prefixes make room for swaps
        assert spill.prefix_hit_rate > recompute.prefix_hit_rate + 0.05  # 27-28% against 20%
    assert reused.spilled_bytes < every.spilled_bytes / 5  # 11 GiB against 145
    assert reused.output_tokens_per_s > every.output_tokens_per_s


def test_a_spill_policy_the_simulator_does_not_know_is_refused():
    config = SimConfig(model=ModelShape("toy", 1, 1, 1, 1.0), memory_bytes=3 * 80,
                       swap_memory_bytes=8 * 80, page_size=10, dtype="float32", spill_prefixes=True)
    with pytest.raises(ValueError, match=r"expected policy in \('reused', 'all', 'none'\), got True"):
        simulate([Request(0.0, 10, 3, (1,))], config, "paged+swap")


def test_swap_is_not_chosen_when_recompute_is_cheaper():
    swap, recompute = _swap_run(swap_bandwidth_bytes_s=1e6)  # a 1 MB/s host link
    assert swap.swap_outs == 0 and swap.preemptions == recompute.preemptions > 0


@pytest.mark.parametrize("spill", ["none", "all"])
@pytest.mark.parametrize("first_output, crossed", [(3, 0), (12, 80)])
def test_a_swapped_sequence_outlives_everything_else_and_still_finishes(first_output, crossed, spill):
    # pages of 10 tokens, 3 of them: two 10-token prompts both need a second page at their first
    # decode step, so the newer one is swapped out; it is the last one left when the other ends.
    model = ModelShape("toy", 1, 1, 1, 1.0)
    cost = CostModel(overhead_s=1.0, bandwidth_bytes_s=1e30, flops=1.0)  # recompute is dear
    # A host tier of 8 pages: the default 64 GiB would be 859 million 80-byte pages (an allocator
    # of 7 GB that took 2.5 minutes to set up).
    config = SimConfig(model=model, memory_bytes=3 * 80, swap_memory_bytes=8 * 80, page_size=10,
                       dtype="float32", max_new_tokens=40, cost=cost, spill_prefixes=spill)
    result = simulate([Request(0.0, 10, first_output, (1,)), Request(0.0, 10, 3, (2,))], config,
                      "paged+swap")
    assert (result.completed, result.swap_outs) == (2, 1)  # and simulate() found no tier page leaked
    # its one page, full, stays in the hot prefix cache: shared again at swap-in, never copied;
    # unless the other sequence grows to 3 pages meanwhile, evicting it: copied out then, and back
    assert result.swap_out_bytes == result.swap_in_bytes == crossed
    # spilled, that page is kept on the tier page it was copied to (no second copy); what is
    # spilled is the other sequence's full page, evicted for the swapped one's return
    assert result.spilled_bytes == (crossed if spill == "all" else 0) and result.restored_bytes == 0
