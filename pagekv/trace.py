"""Request traces: the Mooncake JSONL format, an embedded slice of it, and a synthetic generator.

A request's prompt is a chain of 512-token blocks named by ``hash_ids``; two requests whose first k
ids are equal share their first k * 512 prompt tokens. Each id becomes a deterministic run of token
ids, so prefix caching sees exactly the reuse the trace records.
"""

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

__all__ = ["Request", "TraceError", "load_trace", "default_trace", "synthetic_trace", "prompt_tokens"]

BLOCK_TOKENS = 512
VOCAB = 32000
DEFAULT_TRACE = "mooncake_conversation_head300.jsonl"


class TraceError(ValueError):
    """A malformed trace; the message names the file and line."""


@dataclass(frozen=True)
class Request:
    """One request: arrival (seconds), prompt and output lengths (tokens), prompt block ids."""

    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple


def _parse(lines, source):
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            request = Request(float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                              int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{source}:{number}: expected a JSON object with timestamp, input_length, "
                             f"output_length and hash_ids, got {line.strip()[:80]!r} ({exc})") from None
        if request.input_length < 1 or request.output_length < 1 or request.arrival < 0:
            raise TraceError(f"{source}:{number}: expected positive lengths and a timestamp >= 0, "
                             f"got {line.strip()[:80]!r}")
        if len(request.hash_ids) * BLOCK_TOKENS < request.input_length:
            raise TraceError(f"{source}:{number}: expected {-(-request.input_length // BLOCK_TOKENS)} "
                             f"hash_ids for {request.input_length} tokens, got {len(request.hash_ids)}")
        requests.append(request)
    return sorted(requests, key=lambda r: r.arrival)


def load_trace(path, *, limit=None):
    """Requests of a Mooncake-format JSONL file, sorted by arrival (the first ``limit`` lines)."""
    with open(path) as f:
        lines = f if limit is None else (line for _, line in zip(range(limit), f))
        return _parse(lines, path)


def default_trace():
    """The embedded slice: the first 300 requests of the Mooncake conversation trace (Apache-2.0)."""
    text = resources.files("pagekv.data").joinpath(DEFAULT_TRACE).read_text()
    return _parse(text.splitlines(), DEFAULT_TRACE)


def synthetic_trace(*, num_requests=300, rate=3.0, seed=0, system_prompts=4,
                    system_blocks=4, mean_input=4096, mean_output=300):
    """Poisson arrivals at ``rate`` per second; each prompt starts with one of ``system_prompts``
    shared prefixes of ``system_blocks`` blocks, then a private, log-normally sized remainder."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    next_id = system_prompts * system_blocks
    requests = []
    for t in arrivals:
        system = int(rng.integers(system_prompts))
        private = max(1, int(rng.lognormal(np.log(mean_input), 0.8)))
        total = system_blocks * BLOCK_TOKENS + private
        blocks = list(range(system * system_blocks, (system + 1) * system_blocks))
        extra = -(-total // BLOCK_TOKENS) - system_blocks
        blocks += list(range(next_id, next_id + extra))
        next_id += extra
        output = max(1, min(2048, int(rng.lognormal(np.log(mean_output), 0.7))))
        requests.append(Request(float(t), total, output, tuple(blocks)))
    return requests


def prompt_tokens(request):
    """int32 token ids of a request's prompt: each block id maps to a fixed run of 512 ids."""
    blocks = np.asarray(request.hash_ids[:-(-request.input_length // BLOCK_TOKENS)], np.uint64)
    offsets = np.arange(BLOCK_TOKENS, dtype=np.uint64)
    mixed = (blocks[:, None] + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) ^ \
        offsets[None, :] * np.uint64(0xBF58476D1CE4E5B9)
    mixed ^= mixed >> np.uint64(31)
    return (mixed % np.uint64(VOCAB)).astype(np.int32).ravel()[:request.input_length]
