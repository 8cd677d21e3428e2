"""ServerArgs as RL frameworks build it: directly from upstream's keyword arguments (verl), from a
namespace parsed by a wrapper that prefixes every flag of ``ServerArgs.add_cli_args`` (slime),
and from the command line with upstream's spellings. No model is loaded here."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang.launch_server import build_parser, parse_server_args
from sglang.srt.server_args import ServerArgs, cli_dest, cli_flags
from sglang.srt.server_args_upstream import UPSTREAM_ONLY_FIELDS, server_args_from_kwargs

REPO_ROOT = Path(__file__).resolve().parents[2]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- ServerArgs(**kwargs), as verl builds it -----------------------------------------------

VERL_KWARGS: dict[str, Any] = {
    "model_path": "m", "device": "cpu", "dtype": "bfloat16", "mem_fraction_static": 0.5,
    "enable_memory_saver": True, "base_gpu_id": 2, "gpu_id_step": 1, "tp_size": 1, "dp_size": 1,
    "ep_size": 1, "node_rank": 0, "nnodes": 1, "trust_remote_code": True, "load_format": "dummy",
    "mm_attention_backend": "fa3", "attention_backend": "fa3", "quantization": None,
    "json_model_override_args": "{}", "enable_weights_cpu_backup": True, "log_level": "error",
    "max_running_requests": None, "skip_tokenizer_init": True,
}


def test_verl_kwargs_build_server_args_directly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(**VERL_KWARGS)
    # Upstream-only fields read back as passed; upstream defaults where not passed.
    assert (args.enable_memory_saver, args.base_gpu_id, args.gpu_id_step) == (True, 2, 1)
    assert args.json_model_override_args == "{}" and args.quantization is None
    assert args.pp_size == 1 and args.enable_dp_attention is False
    assert args.attention_backend == "torch_native"  # fa3 -> this build's default on CPU
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    for name in ("enable_memory_saver=True", "base_gpu_id=2", "mm_attention_backend='fa3'",
                 "attention_backend='fa3'", "enable_weights_cpu_backup=True"):
        assert name in warnings[0]
    for silent in ("gpu_id_step", "ep_size", "quantization", "json_model_override_args"):
        assert silent not in warnings[0]


def test_loop_placement_and_tracing_knobs_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Upstream knobs that change when or where work runs, not what it returns, start the
    engine with one warning naming them."""
    knobs = {"scheduler_recv_interval": 4, "numa_node": [0], "enable_trace": True,
             "enable_tokenizer_batch_encode": True, "weight_loader_disable_mmap": True}
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(model_path="m", device="cpu", **knobs)
    assert args.scheduler_recv_interval == 4 and args.numa_node == [0]
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert all(name in warnings[0] for name in knobs)


def test_defaults_of_upstream_fields_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(model_path="m", device="cpu", kv_cache_dtype="auto", pp_size=1,
                          speculative_algorithm=None, uvicorn_access_log_exclude_prefixes=[])
    assert _warnings(caplog) == []
    assert args.kv_cache_dtype == "auto" and args.enable_memory_saver is False


def test_result_changing_and_unknown_keywords_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2', quantization='fp8'"):
        ServerArgs(model_path="m", device="cpu", quantization="fp8", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="enable_dp_attention=True"):
        ServerArgs(model_path="m", device="cpu", enable_dp_attention=True)
    with pytest.raises(TypeError, match="no_such_option"):
        ServerArgs(model_path="m", device="cpu", no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="no_such_option, other"):
        server_args_from_kwargs({"model_path": "m", "no_such_option": 1, "other": 2})
    with pytest.raises(ValueError, match="--attention-backend flashinfer is not available"):
        ServerArgs(model_path="m", device="cpu", attention_backend="flashinfer")


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_lora_backend_triton_is_ours(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """Our LoRA kernels on CUDA are Triton kernels: upstream's triton (AReaL's default) and csgmv
    (upstream's default) name them, so both pass silently and read back."""
    with caplog.at_level(logging.WARNING):
        args = server_args_from_kwargs({"model_path": "m", "device": "cpu",
                                        "lora_backend": backend})
    assert args.lora_backend == backend
    assert _warnings(caplog) == []


def test_other_lora_backends_are_not_applicable(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(model_path="m", device="cpu", lora_backend="torch_native")
    assert args.lora_backend == "torch_native"
    assert ["lora_backend='torch_native'" in w for w in _warnings(caplog)] == [True]


def test_dataclass_behaviour_with_upstream_fields(caplog: pytest.LogCaptureFixture) -> None:
    args = ServerArgs(model_path="m", device="cpu", enable_memory_saver=True, base_gpu_id=1)
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    assert {"enable_memory_saver", "enable_weights_cpu_backup", "pp_size"} <= set(names)
    assert set(names) >= UPSTREAM_ONLY_FIELDS and len(names) == len(set(names))
    # asdict / to_dict carry them (get_server_info reports them, as upstream's does).
    assert args.to_dict()["enable_memory_saver"] is True
    assert dataclasses.asdict(args)["base_gpu_id"] == 1
    # Engine(server_args=...) rebuilds from asdict: the same arguments come back.
    assert ServerArgs(**dataclasses.asdict(args)) == args
    # replace keeps the upstream values it is not told to change.
    changed = dataclasses.replace(args, port=31000)
    assert (changed.port, changed.enable_memory_saver, changed.base_gpu_id) == (31000, True, 1)
    # Pickling (to the engine's child processes) re-runs nothing and loses nothing.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert pickle.loads(pickle.dumps(args)) == args
    assert _warnings(caplog) == []
    # Upstream's fields are keyword-only: the first positional argument is still model_path.
    assert ServerArgs("m", device="cpu").model_path == "m"  # type: ignore[misc]


# ---- add_cli_args behind a slime-style prefixing wrapper --------------------------------------

# The names slime's wrapper leaves out because it sets them itself (the check is against the
# explicit dest, else the first long flag; tp_size matches nothing, as with upstream).
_SKIPPED = {"model_path", "trust_remote_code", "random_seed", "enable_memory_saver", "tp_size",
            "port", "nnodes", "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id",
            "nccl_port", "skip_server_warmup", "enable_return_routed_experts"}


def _add_prefixed_server_args(parser: argparse.ArgumentParser) -> None:
    """Register ServerArgs' flags as ``--sglang-<flag>`` (dest ``sglang_<dest>``), the way slime
    does: by swapping ``parser.add_argument`` while ``ServerArgs.add_cli_args`` runs."""
    original = parser.add_argument

    def prefixed(*flags: str, **kwargs: Any) -> None:
        dest = kwargs.get("dest")
        if dest is None:
            dest = next(f[2:].replace("-", "_") for f in flags if f.startswith("--"))
        if dest in _SKIPPED:
            return
        if "dest" in kwargs:
            kwargs["dest"] = "sglang_" + kwargs["dest"]
        original(*["--sglang-" + f.lstrip("-") for f in flags], **kwargs)

    parser.add_argument = prefixed  # type: ignore[method-assign]
    try:
        ServerArgs.add_cli_args(parser)
    finally:
        parser.add_argument = original  # type: ignore[method-assign]


def _slime_like_server_args(ns: argparse.Namespace, gpus_per_engine: int) -> ServerArgs:
    """What slime's validate_args and _compute_server_args do with the namespace: upstream's
    parallel sizes read under their CLI dests, its own kwargs, then every ServerArgs field the
    namespace holds as ``sglang_<field>``."""
    dp_size = ns.sglang_data_parallel_size
    if dp_size > 1:
        assert ns.sglang_enable_dp_attention
    kwargs: dict[str, Any] = {
        "model_path": "m", "trust_remote_code": True, "random_seed": 1234,
        "enable_memory_saver": True, "host": "127.0.0.1", "port": 31000, "nccl_port": 31001,
        "nnodes": 1, "node_rank": 0, "dist_init_addr": "127.0.0.1:31002", "gpu_id_step": 1,
        "base_gpu_id": 0, "tp_size": gpus_per_engine // ns.sglang_pipeline_parallel_size,
        "dp_size": dp_size, "pp_size": ns.sglang_pipeline_parallel_size,
        "ep_size": ns.sglang_expert_parallel_size, "skip_server_warmup": True,
        "enable_draft_weights_cpu_backup": True,
    }
    for f in dataclasses.fields(ServerArgs):
        if hasattr(ns, f"sglang_{f.name}") and f.name not in kwargs:
            kwargs[f.name] = getattr(ns, f"sglang_{f.name}")
    return ServerArgs(**kwargs)


def test_slime_style_prefixed_namespace_builds_server_args(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    _add_prefixed_server_args(parser)
    parser.format_help()  # the wrapped parser's help renders
    ns = parser.parse_args([
        "--sglang-device", "cpu", "--sglang-mem-fraction-static", "0.4",
        "--sglang-dp-size", "1", "--sglang-attention-backend", "fa3",
        "--sglang-lora-backend", "triton", "--sglang-cuda-graph-bs", "1", "2",
    ])
    # Upstream's dests (first flag) and every upstream-only default are in the namespace.
    for name in ("data_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                 "tensor_parallel_size", "enable_dp_attention", "kv_cache_dtype",
                 "attention_context_parallel_size", "moe_data_parallel_size"):
        assert hasattr(ns, f"sglang_{name}"), name
    assert (ns.sglang_data_parallel_size, ns.sglang_pipeline_parallel_size) == (1, 1)
    assert ns.sglang_expert_parallel_size == 1 and ns.sglang_enable_dp_attention is False
    assert not hasattr(ns, "sglang_model_path") and not hasattr(ns, "sglang_base_gpu_id")
    for f in dataclasses.fields(ServerArgs):
        if cli_dest(f) not in _SKIPPED:
            assert hasattr(ns, "sglang_" + cli_dest(f)), f.name
    with caplog.at_level(logging.WARNING):
        args = _slime_like_server_args(ns, ns.rollout_num_gpus_per_engine)
    assert (args.tp_size, args.dp_size, args.pp_size, args.ep_size) == (1, 1, 1, 1)
    assert (args.mem_fraction_static, args.cuda_graph_bs) == (0.4, [1, 2])
    assert (args.enable_memory_saver, args.port, args.random_seed) == (True, 31000, 1234)
    assert args.attention_backend == "torch_native" and args.lora_backend == "triton"
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "enable_draft_weights_cpu_backup=True" in warnings[0]


# ---- the command line -------------------------------------------------------------------------


def test_add_cli_args_uses_upstream_spellings_and_no_dest() -> None:
    calls: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    parser = argparse.ArgumentParser()
    parser.add_argument = lambda *a, **k: calls.append((a, k))  # type: ignore[method-assign]
    ServerArgs.add_cli_args(parser)
    flags = {a[0]: a for a, _ in calls}
    assert flags["--tensor-parallel-size"] == ("--tensor-parallel-size", "--tp-size")
    assert flags["--data-parallel-size"] == ("--data-parallel-size", "--dp-size")
    assert flags["--expert-parallel-size"] == ("--expert-parallel-size", "--ep-size", "--ep")
    assert flags["--model-path"] == ("--model-path", "--model")
    assert all("dest" not in k for _, k in calls)
    assert len(calls) == len(dataclasses.fields(ServerArgs))
    hidden = {a[0] for a, k in calls if k["help"] == argparse.SUPPRESS}
    assert hidden == {cli_flags(f)[0] for f in dataclasses.fields(ServerArgs)
                      if f.name in UPSTREAM_ONLY_FIELDS}


def test_launch_server_takes_both_spellings_and_upstream_flags() -> None:
    base = ["--model-path", "m", "--device", "cpu"]
    for tp in (["--tp-size", "1"], ["--tensor-parallel-size", "1"]):
        for dp in (["--dp-size", "1"], ["--data-parallel-size", "1"]):
            args = parse_server_args(base + tp + dp + ["--ep", "1", "--pp-size", "1"])
            assert (args.tp_size, args.dp_size, args.ep_size, args.pp_size) == (1, 1, 1, 1)
    args = parse_server_args(base + ["--enable-memory-saver", "--base-gpu-id", "3",
                                     "--lora-backend", "triton"])
    assert (args.enable_memory_saver, args.base_gpu_id, args.lora_backend) == (True, 3, "triton")
    ns = build_parser().parse_args(base)  # upstream-only defaults are in the namespace
    assert (ns.enable_memory_saver, ns.base_gpu_id, ns.lora_backend) == (False, 0, "csgmv")
    assert (ns.tensor_parallel_size, ns.data_parallel_size) == (1, 1)


def test_launch_server_attention_backend_fallback(caplog: pytest.LogCaptureFixture) -> None:
    base = ["--model-path", "m", "--device", "cpu"]
    with caplog.at_level(logging.WARNING):
        args = parse_server_args(base + ["--attention-backend", "fa3",
                                         "--sampling-backend", "flashinfer"])
    assert (args.attention_backend, args.sampling_backend) == ("torch_native", "pytorch")
    assert len(_warnings(caplog)) == 1


def test_from_cli_args_maps_upstream_dests_and_field_names() -> None:
    ns = argparse.Namespace(model_path="m", device="cpu", tensor_parallel_size=1,
                            data_parallel_size=1, expert_parallel_size=1, port=31000,
                            not_a_field="ignored")
    args = ServerArgs.from_cli_args(ns)
    assert (args.tp_size, args.dp_size, args.ep_size, args.port) == (1, 1, 1, 31000)
    assert ServerArgs.from_cli_args(argparse.Namespace(model_path="m", device="cpu",
                                                       tp_size=1)).tp_size == 1


@pytest.mark.parametrize("argv,needle", [
    (["--attention-backend", "nonsense"], "invalid choice"),
    (["--quantization", "fp8"], "quantization='fp8'"),
    (["--attention-backend", "flashinfer"], "flashinfer is not available"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_launch_server_errors_exit_2(argv: list[str], needle: str,
                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model-path", "m", "--device", "cpu", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_real_command_falls_back_for_fa3() -> None:
    """``python -m sglang.launch_server --attention-backend fa3`` gets past argparse (the
    fallback); --quantization fp8 then stops it with exit status 2 naming the value."""
    code = ("import sys; from sglang.launch_server import parse_server_args; "
            "parse_server_args(sys.argv[1:])")
    result = subprocess.run(
        [sys.executable, "-c", code, "--model-path", "m", "--device", "cpu",
         "--attention-backend", "fa3", "--quantization", "fp8"],
        capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT / "python"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "quantization='fp8'" in result.stderr and "invalid choice" not in result.stderr
