"""Constrained decoding's cost: the same generations with and without a grammar.

One engine, one workload of ``--num-prompts`` prompts, each answered under a JSON schema (an
array of ``--items`` integers, so that every answer is long) at temperature 1. The grammar run
goes first; the unconstrained run then generates, per prompt, exactly as many tokens
(``ignore_eos``), so both runs produce the same number of tokens and the ratio is the
grammar's cost per token: filling each row's bitmask on the host, copying it and masking the
logits. ``--rounds`` alternates the two runs and reports the ratio of their medians.

    python benchmark/bench_constrained.py --model-path models/SmolLM2-135M-Instruct
    python benchmark/bench_constrained.py --model-path ... --num-prompts 1 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import sglang as sgl


def _timed(engine: sgl.Engine, prompts: list[str], params: list[dict]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.generate(prompt=prompts, sampling_params=params)
    return time.perf_counter() - start, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument("--dtype", default="auto", help="model dtype (default: auto)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per run (default 32)")
    parser.add_argument("--items", type=int, default=24,
                        help="integers in each answer's array (default 24)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations (default 3)")
    args = parser.parse_args()

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": args.items, "maxItems": args.items}
    prompts = [f"List {args.items} numbers, variant {i}:" for i in range(args.num_prompts)]
    constrained = [{"temperature": 1.0, "max_new_tokens": 8 * args.items, "sampling_seed": i,
                    "json_schema": json.dumps(schema)} for i in range(args.num_prompts)]
    with sgl.Engine(model_path=args.model_path, dtype=args.dtype, log_level="warning") as engine:
        _timed(engine, prompts[:2], constrained[:2])  # warm-up: compiles the schema
        _, outs = _timed(engine, prompts, constrained)
        lengths = [o["meta_info"]["completion_tokens"] for o in outs]
        plain = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": i}
                 for i, n in enumerate(lengths)]
        tokens = sum(lengths)
        with_grammar, without = [], []
        for r in range(args.rounds):
            seconds, _ = _timed(engine, prompts, constrained)
            with_grammar.append(tokens / seconds)
            seconds, _ = _timed(engine, prompts, plain)
            without.append(tokens / seconds)
            print(f"round {r + 1}: json_schema {with_grammar[-1]:8.1f} tok/s   "
                  f"unconstrained {without[-1]:8.1f} tok/s   "
                  f"ratio {with_grammar[-1] / without[-1]:.3f}")
    print(f"{args.num_prompts} prompts, {tokens} tokens per run; median ratio (grammar / none): "
          f"{statistics.median(with_grammar) / statistics.median(without):.3f}")


if __name__ == "__main__":
    main()
