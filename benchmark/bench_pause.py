"""Pause / continue latency with a full running batch, per mode.

For each mode, repeatedly: pause (time to acknowledgement), hold, continue (time until the next
token of any request arrives). Prints median and p99 per mode, and the cost of resuming after
``retract`` (re-prefill) relative to ``in_place``.

    python benchmark/bench_pause.py --model-path models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _consume(engine: object, prompt: list[int], max_new: int, stamps: list[float]) -> None:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    gen = await engine.async_generate(input_ids=prompt, sampling_params=params, stream=True)
    async for _ in gen:
        stamps.append(time.perf_counter())


async def _measure(engine: object, args: argparse.Namespace, mode: str) -> tuple[list, list]:
    stamps: list[float] = []
    # As many tokens as the context leaves room for (more is a 400): the requests must not
    # finish before the trials do; they end in the abort below.
    room = args.context_length - args.prompt_len - 1
    tasks = [
        asyncio.create_task(_consume(engine, [100 + i] * args.prompt_len, room, stamps))
        for i in range(args.batch_size)
    ]
    pause_lat, resume_lat = [], []
    while len(stamps) < args.batch_size * 4:  # every request is decoding
        failed = next((t for t in tasks if t.done()), None)
        if failed is not None:
            raise RuntimeError(f"a request ended before the trials: {failed.exception()!r}")
        await asyncio.sleep(0.01)
    for _ in range(args.trials):
        await asyncio.sleep(args.run_s)
        start = time.perf_counter()
        await engine.async_pause_generation(mode=mode)
        pause_lat.append(time.perf_counter() - start)
        await asyncio.sleep(args.hold_s)
        start = time.perf_counter()
        await engine.async_continue_generation()
        while not stamps or stamps[-1] < start:
            await asyncio.sleep(0.0005)
        resume_lat.append(next(t for t in stamps if t >= start) - start)
    await engine.async_abort_request(abort_all=True)
    await asyncio.gather(*tasks, return_exceptions=True)
    return pause_lat, resume_lat


async def _run(args: argparse.Namespace) -> None:
    import sglang as sgl

    engine = sgl.Engine(
        model_path=args.model_path, log_level="warning", context_length=args.context_length
    )
    try:
        results = {}
        for mode in ("in_place", "retract"):
            results[mode] = await _measure(engine, args, mode)
            await engine.async_flush_cache()
    finally:
        engine.shutdown()
    print(f"batch {args.batch_size}, prompt {args.prompt_len} tokens, {args.trials} trials")
    for mode, (pause_lat, resume_lat) in results.items():
        pause_ms = [1e3 * v for v in pause_lat]
        resume_ms = [1e3 * v for v in resume_lat]
        print(
            f"{mode:9s} pause->ack median {statistics.median(pause_ms):7.1f} ms "
            f"p99 {_pct(pause_ms, 0.99):7.1f} ms | continue->next token median "
            f"{statistics.median(resume_ms):7.1f} ms p99 {_pct(resume_ms, 0.99):7.1f} ms"
        )
    ratio = statistics.median(results["retract"][1]) / statistics.median(results["in_place"][1])
    print(f"resume cost retract / in_place: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="streaming requests decoding while the engine is paused (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        help="prompt length per request, tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=8192,
        help="the engine's context length, tokens (prompt + output) (default: %(default)s)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=10,
        help="pause/continue cycles per mode (default: %(default)s)",
    )
    parser.add_argument("--run-s", type=float, default=0.3, help="decode time between pauses")
    parser.add_argument("--hold-s", type=float, default=0.05, help="time spent paused")
    args = parser.parse_args()
    if not 1 <= args.prompt_len < args.context_length - 1:
        parser.error("--prompt-len must be at least 1 and leave room in --context-length")
    if args.batch_size < 1 or args.trials < 1:
        parser.error("--batch-size and --trials must be at least 1")
    if not all(0 <= t < 3600 for t in (args.run_s, args.hold_s)):  # NaN fails too
        parser.error("--run-s and --hold-s must be seconds in [0, 3600)")
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
