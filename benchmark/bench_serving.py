"""Online serving benchmark: stream N requests to a running server and measure latency.

Requests are sent at ``--request-rate`` requests/s (Poisson arrivals; ``inf``, the default,
sends them all at once), optionally with at most ``--max-concurrency`` in flight. Each request
streams, so the script measures time to first token (TTFT) and inter-token latency (ITL) per
request, and reports throughput (requests/s, output tokens/s) and the median and p99 of TTFT,
ITL and end-to-end latency. Prompts are random token ids of ``--input-len`` tokens and every
request generates exactly ``--output-len`` tokens (``ignore_eos``). With
``--compare-sequential`` the same requests are then sent one at a time and the ratio of the two
output throughputs is printed (the batching speed-up of the server).

    make serve   # in another shell
    python benchmark/bench_serving.py --num-prompts 32 --request-rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    # Skip the start of the vocabulary, where tokenizers keep their special tokens.
    low = min(1000, vocab_size // 4)
    return [
        [rng.randrange(low, vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]


def request_body(args: argparse.Namespace, prompt: list[int]) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request for the chosen API."""
    if args.api == "openai":
        return "/v1/completions", {
            "model": "default",
            "prompt": prompt,
            "max_tokens": args.output_len,
            "temperature": args.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return "/generate", {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": args.output_len,
            "temperature": args.temperature,
            "ignore_eos": True,
        },
    }


def tokens_so_far(api: str, event: dict, previous: int) -> int:
    """Output tokens after this stream event (cumulative for native, deltas for OpenAI)."""
    if api == "openai":
        if event.get("usage"):
            return event["usage"]["completion_tokens"]
        return previous + (1 if event.get("choices") and event["choices"][0]["text"] else 0)
    return event["meta_info"]["completion_tokens"]


async def send_one(
    client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int]
) -> RequestResult:
    """Stream one request; ITL of an event carrying k tokens is its gap / k, counted k times."""
    path, body = request_body(args, prompt)
    result = RequestResult(ok=False, prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                num = tokens_so_far(args.api, event, result.output_len)
                now = time.perf_counter()
                if num > result.output_len:
                    if result.output_len == 0:
                        result.ttft = now - start
                    else:
                        gap = (now - last) / (num - result.output_len)
                        result.itls.extend([gap] * (num - result.output_len))
                    result.output_len, last = num, now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


async def run_load(
    args: argparse.Namespace, prompts: list[list[int]], rate: float, max_concurrency: int | None
) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals at ``rate``); returns results and wall time."""
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:

        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                return await send_one(client, args, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def report(title: str, results: list[RequestResult], duration: float) -> float:
    """Print the metrics of one run; returns its output throughput (tokens/s)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_len for r in ok)
    ttfts = [r.ttft * 1000 for r in ok]
    itls = [x * 1000 for r in ok for x in r.itls]
    e2es = [r.e2e * 1000 for r in ok]
    throughput = output_tokens / duration if duration > 0 else 0.0
    print(f"==== {title} ====")
    print(f"successful requests      {len(ok)} / {len(results)}")
    for r in results:
        if not r.ok:
            print(f"  failed: {r.error}")
            break
    print(f"duration (s)             {duration:.2f}")
    print(f"request throughput       {len(ok) / duration:.2f} req/s")
    print(f"input throughput         {sum(r.prompt_len for r in ok) / duration:.1f} tok/s")
    print(f"output throughput        {throughput:.1f} tok/s")
    for name, values in (("TTFT", ttfts), ("ITL", itls), ("E2E latency", e2es)):
        print(
            f"{name:<12} (ms)        median {percentile(values, 50):9.1f}   "
            f"p99 {percentile(values, 99):9.1f}"
        )
    return throughput


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:30000",
        help="URL of the running server (default: %(default)s)",
    )
    parser.add_argument(
        "--api",
        choices=("native", "openai"),
        default="native",
        help="native: POST /generate; openai: POST /v1/completions",
    )
    parser.add_argument(
        "--api-key", default=None, help="the server's API key, sent as 'Authorization: Bearer KEY'"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=32, help="requests to send (default: %(default)s)"
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=64,
        help="prompt length, tokens (random ids) (default: %(default)s)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=32,
        help="tokens generated per request (ignore_eos) (default: %(default)s)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (Poisson); inf sends all at once",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random prompts and the Poisson arrival gaps (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument(
        "--compare-sequential",
        action="store_true",
        help="also send the requests one at a time and print the speed-up",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    info = httpx.get(args.base_url + "/get_server_info", headers=headers, timeout=60).json()
    prompts = make_prompts(args, info["vocab_size"])
    results, duration = asyncio.run(
        run_load(args, prompts, args.request_rate, args.max_concurrency)
    )
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate} req/s"
    served = report(f"{args.num_prompts} requests, {rate}", results, duration)
    if args.compare_sequential:
        results, duration = asyncio.run(run_load(args, prompts, float("inf"), 1))
        sequential = report("same requests, one at a time", results, duration)
        if sequential > 0:
            print(f"output throughput ratio (load / sequential): {served / sequential:.2f}x")


if __name__ == "__main__":
    main()
