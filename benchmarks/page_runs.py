"""Page runs under serving churn: how physically consecutive KVCacheManager keeps page tables, and
what one decode step costs on them.

The real KVCacheManager is driven through continuous-batching churn: ``--live`` sequences decode
side by side, one token per step each (one ``append_tokens`` call); a sequence that has generated
its tokens is freed and a new one admitted with a random prompt. Then, for the live sequences:

- the share of page-table transitions that go to the physically next page, and the page-weighted
  mean run length (a page in a run of 8 counts 8);
- one decode step with S1's heads (32 query / 8 KV heads, head_dim 128) over those tables, timed
  in paired rounds (LLC evicted before each call) against the same sequences on consecutive pages
  and on pages in random order.

    python benchmarks/page_runs.py --rounds 21
"""

import argparse

import numba
import numpy as np

from attention_cases import in_kv_cache, streaming_read
from paired import paired_times
from pagekv import KVCacheManager, KVCacheSpec, attention

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # S1's


def churn_tables(*, live, steps, page_size, prompt_tokens, new_tokens, prefix_caching=False, seed=0):
    """Drive a KVCacheManager through ``steps`` decode steps of churn; return the live tables.

    With ``prefix_caching`` every full page stays cached after its sequence ends, so the pool runs
    full of cached pages and every allocation evicts (random prompts: no hits).

    Returns
    -------
    tables : list of int32 ndarray, each shape (pages of that sequence,)
        Physical pages of each live sequence, in logical order.
    seq_lens : int32 ndarray, shape (live,)
    num_pages : int
        Size of the pool the pages come from.
    """
    rng = np.random.default_rng(seed)
    max_pages = -(-(prompt_tokens[1] + new_tokens[1]) // page_size)
    num_pages = live * max_pages + live  # never short of pages: the policy alone decides
    manager = KVCacheManager(num_pages=num_pages, page_size=page_size, max_seqs=live,
                             max_pages_per_seq=max_pages, enable_prefix_caching=prefix_caching)
    left = {}

    def admit(seq_id):
        manager.add_sequence(seq_id, rng.integers(0, 32000, rng.integers(*prompt_tokens, endpoint=True)))
        left[seq_id] = int(rng.integers(*new_tokens, endpoint=True))

    next_id = 0
    for next_id in range(live):
        admit(next_id)
    for _ in range(steps):
        seq_ids = list(left)
        manager.append_tokens(seq_ids, rng.integers(0, 32000, len(seq_ids)))
        for seq_id in seq_ids:
            left[seq_id] -= 1
            if left[seq_id] == 0:
                del left[seq_id]
                manager.free(seq_id)
                next_id += 1
                admit(next_id)
    seq_ids = list(left)
    tables = [manager.page_table(s).copy() for s in seq_ids]
    return tables, np.array([manager.seq_len(s) for s in seq_ids], np.int32), num_pages


def run_stats(tables):
    """(share of transitions to the physically next page, page-weighted mean run length)."""
    steps = np.concatenate([np.diff(t) for t in tables])
    runs = np.concatenate([np.diff(np.flatnonzero(np.diff(t, prepend=-2, append=-2) != 1))
                           for t in tables])
    return float(np.mean(steps == 1)), float((runs * runs).sum() / runs.sum())


def consecutive_tables(tables):
    """The same sequences, each on one run of pages (sequence i right after sequence i - 1)."""
    starts = np.cumsum([0] + [len(t) for t in tables[:-1]])
    return [np.arange(s, s + len(t), dtype=np.int32) for s, t in zip(starts, tables)]


def random_tables(tables, num_pages, rng):
    """The same sequences on distinct pages in random order."""
    pages = rng.permutation(num_pages)[:sum(len(t) for t in tables)].astype(np.int32)
    return np.split(pages, np.cumsum([len(t) for t in tables])[:-1])


def as_block_table(tables):
    """int32 [num_seqs, max pages] with each sequence's pages left-aligned (the rest 0)."""
    table = np.zeros((len(tables), max(len(t) for t in tables)), np.int32)
    for row, pages in zip(table, tables):
        row[:len(pages)] = pages
    return table


def decode_step(kind, num_pages, page_size, seq_lens, rng):
    """A function of a block table that returns one timed-ready decode call on a shared cache."""
    spec = KVCacheSpec(num_layers=1, page_size=page_size, dtype=kind, num_kv_heads=HEADS["num_kv_heads"],
                       head_dim=HEADS["head_dim"])
    shape = (num_pages, HEADS["num_kv_heads"], page_size, HEADS["head_dim"])
    k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    if kind == "bfloat16":
        k, v = ((x.view(np.uint32) >> 16).astype(np.uint16) for x in (k, v))
    k, v = in_kv_cache(spec, k, v)
    q = rng.standard_normal((len(seq_lens), HEADS["num_q_heads"], HEADS["head_dim"]), dtype=np.float32)
    plan = attention.plan_decode(seq_lens, page_size=page_size)
    out = np.empty_like(q)

    def on(table):
        def run():
            attention.paged_decode_attention(q, k, v, table, seq_lens, out=out, plan=plan)
        run()  # compiled and warm before it is timed
        return run
    return on, int(2 * seq_lens.sum() * k.shape[1] * k.shape[3] * k.itemsize)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="paired rounds per timing")
    parser.add_argument("--live", type=int, default=16, help="sequences decoding side by side")
    parser.add_argument("--steps", type=int, default=30000, help="decode steps of churn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(100, 2000), metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=(50, 1500), metavar=("MIN", "MAX"))
    parser.add_argument("--kinds", nargs="+", default=("bfloat16", "float32"))
    parser.add_argument("--prefix-caching", action="store_true",
                        help="keep finished sequences' full pages cached (the pool runs full)")
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    tables, seq_lens, num_pages = churn_tables(
        live=args.live, steps=args.steps, page_size=args.page_size,
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, prefix_caching=args.prefix_caching)
    layouts = {"served": tables, "consecutive": consecutive_tables(tables),
               "random": random_tables(tables, num_pages, rng)}
    print(f"{args.live} sequences after {args.steps} decode steps of churn, page {args.page_size}, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}, {int(seq_lens.sum())} tokens; "
          f"{numba.get_num_threads()} threads\n")
    print("| pages | next page is the physically next one | mean run (pages, page-weighted) |")
    print("|---|---|---|")
    for name, layout in layouts.items():
        share, run = run_stats(layout)
        print(f"| {name} | {100 * share:.1f}% | {run:.1f} |")
    evict = streaming_read()[0]
    print("\n| KV | served ÷ consecutive time | random ÷ consecutive time |")
    print("|---|---|---|")
    for kind in args.kinds:
        on, _ = decode_step(kind, num_pages, args.page_size, seq_lens, rng)
        runs = {name: on(as_block_table(layout)) for name, layout in layouts.items()}
        ratios = []
        for name in ("served", "random"):
            a, b = paired_times(runs[name], runs["consecutive"], args.rounds, before_each=evict)
            ratios.append(float(np.median(a / b)))
        print(f"| {kind} | {ratios[0]:.3f} | {ratios[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
