"""The load mode of ``aah bench vllm``: many requests against one engine, and what they measure.

:func:`run_load` (in the vLLM environment, called by :mod:`aah.vllm.runner`) starts an engine
with a stat logger that keeps the largest ``num_running_reqs`` of vLLM's scheduler statistics,
adds ``N`` token prompts at their arrival times (all at once, or Poisson arrivals at a rate) and
steps the engine itself until every request has finished. Per request it records, on this
process's monotonic clock, the arrival (the scheduled time, so a request the engine is too busy
to take in at once is charged its wait), the step that returned its first generated token, and
the step that finished it. It reads vLLM's own maximum concurrency for ``max_model_len`` tokens
per request from the engine's cache configuration (``kv_cache_max_concurrency``, set by
``update_kv_cache_capacity`` from ``get_max_concurrency_for_kv_cache_config`` in
``vllm/v1/core/kv_cache_utils.py``, the figure of vLLM's start-up line "Maximum concurrency for N
tokens per request").

The helpers (:func:`percentile`, :func:`arrival_offsets`, :func:`token_prompts`,
:func:`summarize`) import no vLLM; :func:`token_prompts` also draws the prompts of the bench's
prefill and decode rounds.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ENGINE_KEYS", "RATIO_KEYS", "arrival_offsets", "percentile", "ratios", "run_load", "summarize",
           "token_prompts"]

#: The keys of each engine's load results in ``aah bench vllm --load``'s JSON.
ENGINE_KEYS = (
    "max_concurrency", "kv_cache_tokens", "kv_cache_blocks", "block_size", "peak_running", "peak_kv_cache_usage",
    "requests", "output_tokens", "duration_s", "output_tok_s", "ttft_median_s", "ttft_p99_s", "e2e_median_s",
    "e2e_p99_s", "startup_s",
)
#: The keys whose plugin/vanilla ratio the JSON's ``ratios`` holds.
RATIO_KEYS = ("max_concurrency", "peak_running", "output_tok_s", "ttft_median_s", "ttft_p99_s", "e2e_median_s",
              "e2e_p99_s")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values``, linearly interpolated between
    the closest ranks (numpy's default): rank ``q / 100 * (n - 1)`` of the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(float(v) for v in values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def arrival_offsets(count: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``count`` requests arrives: all at 0 without a
    ``rate``; else a Poisson process of ``rate`` requests per second: the first at 0, then gaps
    drawn from the exponential distribution of mean ``1 / rate`` (seeded by ``seed``)."""
    if count < 1:
        raise ValueError(f"requests must be >= 1, got {count}")
    if rate is None:
        return [0.0] * count
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate}")
    rng = random.Random(seed)
    offsets, now = [0.0], 0.0
    for _ in range(count - 1):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def token_prompts(count: int, length: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """``count`` token prompts of ``length`` random ids in ``[0, vocab)``, distinct per request (so
    prefix caching shares none of them); with ``shared_prefix`` > 0 their first ``shared_prefix``
    tokens are the same for all (a prefix the cache can share), the rest distinct."""
    if not 0 <= shared_prefix < length:
        raise ValueError(f"shared prefix must be in [0, {length}) (below the prompt length), got {shared_prefix}")
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (length - shared_prefix,), generator=g).tolist() for _ in range(count)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(plugin: dict[str, Any], vanilla: dict[str, Any]) -> dict[str, float | None]:
    """``plugin[key] / vanilla[key]`` for every key of :data:`RATIO_KEYS` (``None`` where vanilla's is 0)."""
    return {key: _ratio(plugin.get(key), vanilla.get(key)) for key in RATIO_KEYS}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The :data:`ENGINE_KEYS` of one engine from :func:`run_load`'s result: output tokens/s is
    every generated token over the time from the first arrival to the last finish; time to first
    token and end-to-end latency are per request from its arrival (median and 99th percentile)."""
    requests = result["requests"]
    ttft = [r["first_token_s"] - r["arrival_s"] for r in requests]
    e2e = [r["finish_s"] - r["arrival_s"] for r in requests]
    tokens = sum(r["output_tokens"] for r in requests)
    duration = max(r["finish_s"] for r in requests) - min(r["arrival_s"] for r in requests)
    return {
        "max_concurrency": result["max_concurrency"],
        "kv_cache_tokens": result["kv_cache_tokens"],
        "kv_cache_blocks": result["kv_cache_blocks"],
        "block_size": result["block_size"],
        "peak_running": result["peak_running"],
        "peak_kv_cache_usage": result["peak_kv_cache_usage"],
        "requests": len(requests),
        "output_tokens": tokens,
        "duration_s": duration,
        "output_tok_s": tokens / duration if duration > 0 else None,
        "ttft_median_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_median_s": statistics.median(e2e),
        "e2e_p99_s": percentile(e2e, 99),
        "startup_s": result["startup_s"],
    }


def run_load(model: str, args: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    """Start an engine on ``model`` with the engine arguments ``args``, run the requests of
    ``load`` (``{"prompts": [[ids]...], "arrivals": [s...], "max_tokens": int}``) and return
    ``{"requests": [{"arrival_s", "first_token_s", "finish_s", "output_tokens"}...],
    "max_concurrency", "kv_cache_tokens", "kv_cache_blocks", "block_size", "peak_running",
    "peak_kv_cache_usage", "startup_s"}``.

    Scheduler statistics need ``disable_log_stats=False`` (forced here)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    from vllm import SamplingParams

    peak = {"running": 0, "usage": 0.0}

    class PeakRunning(StatLoggerBase):
        """Keeps the largest number of running requests and KV cache usage the scheduler reports."""

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                peak["running"] = max(peak["running"], int(scheduler_stats.num_running_reqs))
                peak["usage"] = max(peak["usage"], float(scheduler_stats.kv_cache_usage))

        def log_engine_initialized(self):
            pass

    started = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **{**args, "disable_log_stats": False}),
                                        usage_context=UsageContext.LLM_CLASS, stat_loggers=[PeakRunning])
    startup = time.perf_counter() - started
    cache = engine.vllm_config.cache_config
    params = SamplingParams(temperature=0.0, max_tokens=int(load["max_tokens"]), ignore_eos=True, detokenize=False)
    order = sorted(range(len(load["prompts"])), key=lambda i: (load["arrivals"][i], i))
    records: list[dict[str, Any]] = [{} for _ in order]
    start = time.perf_counter()
    next_up, ids = 0, {}
    while next_up < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_up < len(order) and load["arrivals"][order[next_up]] <= now:
            i = order[next_up]
            records[i]["arrival_s"] = float(load["arrivals"][i])
            given = engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(load["prompts"][i])), params)
            ids[str(i)] = ids[given] = i  # outputs name the request as given, or as the engine renamed it
            next_up += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, load["arrivals"][order[next_up]] - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            record = records[ids[out.request_id]]
            generated = len(out.outputs[0].token_ids) if out.outputs else 0
            if generated and "first_token_s" not in record:
                record["first_token_s"] = now
            if out.finished:
                record["finish_s"] = now
                record["output_tokens"] = generated
    result = {
        "requests": records,
        "max_concurrency": getattr(cache, "kv_cache_max_concurrency", None),
        "kv_cache_tokens": getattr(cache, "kv_cache_size_tokens", None),
        "kv_cache_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "peak_running": peak["running"],
        "peak_kv_cache_usage": peak["usage"],
        "startup_s": startup,
    }
    del engine
    return result
