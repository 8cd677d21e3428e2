"""Runs the offline workload on vLLM, under vLLM's own Python (called by
bench_offline_throughput.py --compare vllm; it imports nothing of this repository).

    VLLM_PYTHON benchmark/vllm_worker.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model_path", "dtype", "threads", "batch1_tokens", "batch1_runs",
"temperature", "top_p", "top_k", "return_logprob", "work": [[ids, n], ...]} (the sampling
keys optional: greedy, no logprobs).
RESULT.json: {"throughput": out tok/s, "batch1": median tok/s of batch1_runs runs,
"startup_s": s}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache on CPU
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    prefix_caching = bool(spec.get("prefix_caching", False))
    llm = LLM(
        model=spec["model_path"], dtype=spec["dtype"], seed=0,
        enable_prefix_caching=prefix_caching,
    )
    startup = time.perf_counter() - start
    work = spec["work"]

    temperature = spec.get("temperature", 0.0)
    sampling = {"temperature": temperature}
    if temperature > 0:
        sampling.update(top_p=spec.get("top_p", 1.0), top_k=spec.get("top_k", -1))
    if spec.get("return_logprob"):
        sampling["logprobs"] = 0  # the chosen token's logprob only

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, **sampling)

    llm.generate([{"prompt_token_ids": work[0][0]}], params(8), use_tqdm=False)  # warm-up
    if prefix_caching:  # as the engine's cache is flushed: no prompt of the timed run cached
        llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids, _ in work], [params(n) for _, n in work], use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt, n = work[0][0][:32], spec["batch1_tokens"]
    llm.generate([{"prompt_token_ids": prompt}], params(n), use_tqdm=False)
    rates = []
    for _ in range(max(1, spec.get("batch1_runs", 1))):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params(n), use_tqdm=False)
        rates.append(n / (time.perf_counter() - start))
    batch1 = statistics.median(rates)
    with open(sys.argv[2], "w") as f:
        json.dump({"throughput": num_out / elapsed, "batch1": batch1, "startup_s": startup}, f)


if __name__ == "__main__":
    main()
