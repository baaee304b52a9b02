"""Run vLLM offline on token prompts and report log-probabilities, tokens and timings as JSON.

``python -m aah.vllm.runner SPEC.json OUT.json`` (in the vLLM environment). The spec is
``{"model": DIR, "engines": [ENGINE, ...], "in_process": bool}`` (``in_process``: vLLM's engine
core and worker run in this process, so vLLM is imported once for all engines); each ``ENGINE`` is
``{"name": str, "windows": PATH or null, "engine_args": {...}, "rounds": [ROUND, ...]}`` (and
optionally its own ``"model"``) with
``ROUND = {"prompts": [[token ids]...], "max_tokens": int, "prompt_logprobs": bool}``. The
engines run one after the other, each with ``AAH_WINDOWS`` set to its ``windows`` (``null``:
vanilla vLLM, with ``AAH_WINDOWS`` unset and the model config's ``aah_windows`` overridden; no
``windows`` key: ``AAH_WINDOWS`` unset, so the model's ``config.json`` decides); the rounds of
an engine run in order on the same engine (so a later round can hit the prefix cache of an
earlier one). A windows file or setting the plugin refuses ends the run before the engine starts,
with exit status 2 and the refusal's one line last on stderr. ``OUT.json`` maps each engine's
name to
``{"rounds": [[REQUEST, ...], ...], "seconds": [...], "startup_s": float}``, where ``REQUEST`` is
``{"prompt_logprobs": [float] (one per prompt token after the first), "tokens": [int],
"logprobs": [float]}``: the greedy tokens and their log-probabilities (with
``"disable_log_stats": false`` among the engine arguments also ``first_token_ts`` and
``last_token_ts``, the engine's monotonic times of the first and last generated token).

An engine with ``"load": {"prompts": [[ids]...], "arrivals": [s...], "max_tokens": int}`` in place
of ``rounds`` runs those requests at their arrival times on an engine it steps itself
(:func:`aah.vllm.load.run_load`); its ``OUT.json`` entry is that function's result. An engine whose
``engine_args`` name ``kv_cache_memory_bytes`` gets that KV cache size (``VLLM_CPU_KVCACHE_SPACE``,
which vLLM's CPU platform would put in its place, is unset for it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from .plan import CONFIG_KEY, ENV_VAR
from .startup import StartupError

__all__ = ["run_engine", "main"]


def run_engine(model: str, engine: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run its ``rounds`` (or its ``load``) on it, shut it down."""
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    args = {"dtype": "float32", "seed": 0, "skip_tokenizer_init": True, "gpu_memory_utilization": 0.3,
            **engine.get("engine_args", {})}
    os.environ.pop(ENV_VAR, None)
    if engine.get("windows"):
        os.environ[ENV_VAR] = str(engine["windows"])
    elif "windows" in engine:  # vanilla, even where the model's config.json names a windows file
        args["hf_overrides"] = {CONFIG_KEY: None, **args.get("hf_overrides", {})}
    if "kv_cache_memory_bytes" in args:  # the CPU platform would replace it with the variable's GiB
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.get("kv_cache_gib", 1)))
    if "load" in engine:
        from .load import run_load

        result = run_load(model, args, engine["load"])
        _free()
        return result
    started = time.perf_counter()
    llm = LLM(model=model, **args)
    startup = time.perf_counter() - started
    rounds, seconds = [], []
    for spec in engine["rounds"]:
        params = SamplingParams(
            temperature=0.0, max_tokens=int(spec.get("max_tokens", 1)), logprobs=0, ignore_eos=True,
            prompt_logprobs=0 if spec.get("prompt_logprobs", False) else None, detokenize=False,
        )
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        rounds.append([_request(prompt, out) for prompt, out in zip(spec["prompts"], outputs)])
    del llm
    _free()
    return {"rounds": rounds, "seconds": seconds, "startup_s": startup}


def _request(prompt: list[int], out) -> dict[str, Any]:
    prompt_lp = []
    if out.prompt_logprobs is not None:
        for token, entry in zip(prompt[1:], out.prompt_logprobs[1:]):
            prompt_lp.append(float(entry[token].logprob))
    completion = out.outputs[0]
    logprobs = [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs or [])]
    request = {"prompt_logprobs": prompt_lp, "tokens": list(completion.token_ids), "logprobs": logprobs}
    metrics = getattr(out, "metrics", None)
    if metrics is not None and getattr(metrics, "first_token_ts", 0):
        request["first_token_ts"] = float(metrics.first_token_ts)
        request["last_token_ts"] = float(metrics.last_token_ts)
    return request


def _free() -> None:
    import gc

    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # nothing to clean in this process
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m aah.vllm.runner SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        spec = json.load(fh)
    if spec.get("in_process"):  # engine core and worker in this process: one import of vLLM for all engines
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for engine in spec["engines"]:
            engine.setdefault("engine_args", {}).setdefault("distributed_executor_backend", "uni")
    try:
        result = {engine["name"]: run_engine(engine.get("model", spec["model"]), engine) for engine in spec["engines"]}
    except StartupError as exc:  # refused before the engine started: its one line, last
        print(exc, file=sys.stderr)
        return 2
    with open(argv[1], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
