"""The ``pagekv`` command: simulate serving traffic, plan capacity, benchmark this machine, info.

    pagekv simulate                  # the embedded Mooncake slice, llama-3-8b, 16 GiB of KV cache
    pagekv simulate --trace FILE     # a full trace (Mooncake JSONL)
    pagekv plan --model llama-3-70b --memory 80GiB --context 32768
    pagekv bench                     # bandwidth, decode kernel GB/s, allocator ns/page (<= 60 s
                                     # once the kernels are compiled)
    pagekv info                      # versions, threads, CPU features, kernel cache
"""

import argparse
import math
import os
import re
import sys

from pagekv.models import MAX_CONTEXT, PRESETS, ModelShape
from pagekv.spec import DTYPES
from pagekv.sim import POLICIES
from pagekv.spill import SPILL_POLICIES

__all__ = ["main"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text):
    """Bytes of a size such as ``16GiB``, ``512MB`` or ``1000000``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 16GiB or 512MB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _output_file(text):
    """A path a file can be written to: checked before a long run, not after it."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"expected a file path in a writable folder, got {text!r}")
    return text


def _model_args(parser):
    group = parser.add_argument_group("model (a preset, or explicit shape flags)")
    group.add_argument("--model", choices=sorted(PRESETS), default="llama-3-8b",
                       help="model preset (default: %(default)s)")
    group.add_argument("--layers", type=_positive, help="number of layers (overrides the preset)")
    group.add_argument("--kv-heads", type=_positive, help="KV heads per layer (overrides the preset)")
    group.add_argument("--head-dim", type=_positive, help="head dimension (overrides the preset)")
    group.add_argument("--params", type=_positive_float,
                       help="parameter count, e.g. 8e9 (overrides the preset)")
    parser.add_argument("--memory", type=parse_size, default=parse_size("16GiB"),
                        help="KV-cache budget, e.g. 16GiB (default: 16GiB)")
    parser.add_argument("--page-size", type=_positive, default=16, help="tokens per page (default: 16)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                        help="KV-cache dtype; float8_e4m3fn holds twice bfloat16's tokens "
                        "(default: bfloat16)")


def _model(args):
    preset = PRESETS[args.model]
    return ModelShape(args.model if not (args.layers or args.kv_heads or args.head_dim) else "custom",
                      args.layers or preset.num_layers, args.kv_heads or preset.num_kv_heads,
                      args.head_dim or preset.head_dim, args.params or preset.num_params)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="pagekv", description="Paged KV cache for LLM inference on CPUs: see what paging does "
        "for your model's memory, and how fast attention runs over pages on this machine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser("simulate", help="replay serving traffic under contiguous vs paged KV memory",
                         description="Replay a request trace through a continuous-batching server "
                         "driven by pagekv's KVCacheManager, once per KV-memory policy: contiguous "
                         "reservation of each request's maximum context, paged, paged with prefix "
                         "caching, and that with preemption by swapping to host memory when cheaper "
                         "than recomputing. Time is simulated by a fixed cost model, so runs are "
                         "deterministic.")
    source = sim.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace (default: the "
                        "embedded first 300 requests of the Mooncake conversation trace)")
    source.add_argument("--synthetic", action="store_true",
                        help="generate Poisson arrivals with shared system prompts instead")
    sim.add_argument("--limit", type=_positive, help="only the first N requests of the trace")
    sim.add_argument("--num-requests", type=_positive, default=300, help="--synthetic: requests")
    sim.add_argument("--rate", type=_positive_float, default=3.0, help="--synthetic: arrivals per second")
    sim.add_argument("--seed", type=int, default=0, help="--synthetic: random seed")
    _model_args(sim)
    sim.add_argument("--max-seqs", type=_positive, default=256, help="running sequences at most")
    sim.add_argument("--max-new-tokens", type=_positive, default=2048,
                     help="output cap; contiguous reserves prompt + this (default: 2048)")
    sim.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                     help="policies to compare (default: all)")
    sim.add_argument("--swap-memory", type=parse_size, default=parse_size("64GiB"),
                     help="paged+swap: host memory for swapped-out pages (default: 64GiB)")
    sim.add_argument("--spill-prefixes", choices=list(SPILL_POLICIES), default="reused",
                     help="paged+swap: host memory is also a second-level prefix cache: which "
                     "evicted prefix pages are copied there, to be copied back when a prompt hits "
                     "them: those a prompt hit while hot (default), all, or none")
    sim.add_argument("--attention", action="store_true",
                     help="also run the real decode kernel on one layer of random KV pages "
                     "(every 16th step) and report its time per step and GB/s")
    sim.add_argument("--plot", metavar="FILE.png", type=_output_file,
                     help="draw memory use and running sequences over time (needs matplotlib: "
                     "pip install 'pagekv[plot]')")
    sim.add_argument("--json", metavar="FILE", type=_output_file, help="write every figure as JSON")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")

    plan = sub.add_parser("plan", help="bytes, pages and sequences that fit, for a model and budget",
                          description="Capacity planning: bytes per token and per page, pages in "
                          "the budget, and how many sequences of a given length fit paged versus "
                          "reserved contiguously for a maximum context.")
    _model_args(plan)
    plan.add_argument("--context", type=_positive, default=8192, help="tokens per sequence")
    plan.add_argument("--max-context", type=_positive, default=MAX_CONTEXT,
                      help="the maximum context a contiguous allocator reserves (default: %(default)s)")

    sub.add_parser("bench", help="measure this machine (<= 60 s): bandwidth, decode GB/s, allocator",
                   description="Streaming-read bandwidth, paged decode attention GB/s and its share of "
                   "that bandwidth, and the page allocator's ns per page, measured here. The first "
                   "run also compiles the kernels (1-3 min, once, under a progress bar).")
    sub.add_parser("info", help="versions, threading, CPU features, kernel cache",
                   description="What pagekv runs on: versions, Numba's threading layer and thread "
                   "count, CPU features, the kernel cache and whether the kernels are compiled.")
    return parser


def main(argv=None):
    """Entry point of the ``pagekv`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from pagekv import commands

    try:
        return getattr(commands, args.command.replace("-", "_"))(args, _model if hasattr(args, "model")
                                                                  else None)
    except commands.CommandError as exc:
        print(f"pagekv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
