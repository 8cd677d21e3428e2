"""LoRA cost ratio: the same greedy workload on the base model alone, then spread over 4
adapters (one batch mixes them), in one engine; prints decode throughput of each and the ratio.
Then adapter B's throughput while adapter A generates too, without and with A being paused,
reloaded and continued every ``--update-every`` seconds (the multi-tenant RL pattern).

    python benchmark/bench_lora.py [--model models/SmolLM2-135M-Instruct] [--rank 16]

Adapters are random PEFT checkpoints (every projection adapted) written to a temp directory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def write_adapters(model: str, root: Path, num: int, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    paths = {}
    for i in range(num):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        peft_model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets)
        )
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.01)
        path = root / f"lora{i}"
        peft_model.save_pretrained(path)
        paths[f"lora{i}"] = str(path)
    return paths


def run(engine, prompts: list[list[int]], loras: list[str | None], max_new: int) -> float:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def b_throughput(engine, paths: dict[str, str], prompts: list[list[int]], max_new: int,
                 update_every: float | None, mode: str = "in_place") -> tuple[float, int]:
    """B's tokens/s while A's requests run alongside (and, with ``update_every``, A is paused
    (retract), reloaded and continued that often); returns (B tok/s, number of updates)."""
    import threading

    names = list(paths)
    a, b = names[0], names[1]
    done = threading.Event()
    updates = 0

    def updater() -> None:
        nonlocal updates
        while not done.wait(update_every):
            engine.pause_generation(mode=mode, lora_name=a)
            out = engine.load_lora_adapter(a, paths[names[2 + updates % 2]])
            assert out.success, out.error_message
            engine.continue_generation(lora_name=a)
            updates += 1

    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    rollout_a = threading.Thread(target=engine.generate, kwargs=dict(
        input_ids=prompts, sampling_params=params, lora_path=[a] * len(prompts)))
    rollout_a.start()
    thread = threading.Thread(target=updater) if update_every else None
    if thread is not None:
        thread.start()
    tput = run(engine, prompts, [b] * len(prompts), max_new)
    done.set()
    rollout_a.join()
    if thread is not None:
        thread.join()
    return tput, updates


def main() -> None:
    import sglang as sgl

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="models/SmolLM2-135M-Instruct",
        help="model directory (Hugging Face layout); the random adapters are made for it "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=16,
        help="LoRA rank of the random adapters (default: %(default)s)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=16,
        help="requests per run; in the A and B runs each adapter gets half as many "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-new",
        type=int,
        default=64,
        help="tokens generated per request (ignore_eos); twice as many in the A and B runs "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of the base and of the mixed workload; the best throughput of each counts "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--update-every",
        type=float,
        default=2.0,
        help="seconds between A's pause + reload + continue cycles (0: no updates) "
        "(default: %(default)s)",
    )
    parser.add_argument("--pause-mode", default="in_place",
                        help="how A pauses for its update: in_place keeps its KV, retract "
                        "re-prefills A's requests under the new weights")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(args.model, Path(tmp), 4, args.rank)
        engine = sgl.Engine(
            model_path=args.model, random_seed=0, max_total_tokens=65536,
            lora_paths=[f"{k}={v}" for k, v in paths.items()], max_loras_per_batch=4,
        )
        try:
            prompts = [[1 + i, 200 + i, 300, 400 + i] * 8 for i in range(args.num_requests)]
            names = list(paths)
            mixed = [names[i % 4] for i in range(args.num_requests)]
            run(engine, prompts[:2], [None, names[0]], 4)  # warm up
            base = max(run(engine, prompts, [None] * len(prompts), args.max_new)
                       for _ in range(args.repeats))
            lora = max(run(engine, prompts, mixed, args.max_new) for _ in range(args.repeats))
            half = prompts[: args.num_requests // 2]
            b_plain, _ = b_throughput(engine, paths, half, 2 * args.max_new, None)
            b_upd, n_upd = b_throughput(
                engine, paths, half, 2 * args.max_new, args.update_every, args.pause_mode
            )
        finally:
            engine.shutdown()
    print(f"base alone: {base:.1f} tok/s; 4 adapters mixed: {lora:.1f} tok/s; "
          f"LoRA cost ratio (base / mixed): {base / lora:.2f}x "
          f"({args.num_requests} requests x {args.max_new} tokens, rank {args.rank})")
    print(f"adapter B with A generating: {b_plain:.1f} tok/s; with A paused ({args.pause_mode})"
          f"+reloaded+continued every {args.update_every:g} s ({n_upd} updates): "
          f"{b_upd:.1f} tok/s")


if __name__ == "__main__":
    main()
