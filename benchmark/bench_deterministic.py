"""Cost of --enable-deterministic-inference: engine throughput in both modes, same run.

Runs the mixed offline workload of bench_offline_throughput.py through ``sglang.Engine`` in
normal and in deterministic mode and prints both throughputs, batch-1 decode speeds and the
ratios (goal: deterministic mode costs at most 1.5x on CPU).

    python benchmark/bench_deterministic.py --model-path models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse

from bench_offline_throughput import (
    add_workload_args,
    check_workload_args,
    make_workload,
    run_engine,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the engine's dtype (default: %(default)s)",
    )
    add_workload_args(parser)
    args = parser.parse_args()
    check_workload_args(parser, args)

    from transformers import AutoConfig

    work = make_workload(args, AutoConfig.from_pretrained(args.model_path).vocab_size)
    args.deterministic = False
    normal = run_engine(args, work)
    args.deterministic = True
    det = run_engine(args, work)
    print(f"normal        : {normal[0]:8.1f} out tok/s   batch-1 decode {normal[1]:6.1f} tok/s")
    print(f"deterministic : {det[0]:8.1f} out tok/s   batch-1 decode {det[1]:6.1f} tok/s")
    print(
        f"cost (normal/deterministic): throughput {normal[0] / det[0]:.2f}x   "
        f"batch-1 decode {normal[1] / det[1]:.2f}x"
    )


if __name__ == "__main__":
    main()
