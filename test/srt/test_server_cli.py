"""The command line of ``python -m sglang.launch_server`` (no model is loaded here)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.launch_server import build_parser, parse_server_args
from sglang.srt.server_args import ServerArgs, own_fields

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [str(REPO_ROOT / "python"), str(REPO_ROOT / "sgl-kernel" / "python")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "sglang.launch_server"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=120)


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def test_help_lists_every_flag_with_its_help() -> None:
    result = _run_cli("--help")
    assert result.returncode == 0, result.stderr
    # argparse wraps lines (also after hyphens): compare with all whitespace removed.
    text = "".join(result.stdout.split())
    for field in own_fields():
        assert _flag(field) in text, field.name
        help_text = field.metadata.get("help", "")
        assert len(help_text) > 10, f"{field.name} has no real help text"
        assert "".join(help_text.split()) in text, field.name


def test_help_does_not_import_torch() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['launch_server', '--help']\n"
        "try:\n"
        "    runpy.run_module('sglang.launch_server', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write('TORCH=' + str('torch' in sys.modules))\n"
    )
    result = _run_cli(code=code)
    assert "TORCH=False" in result.stderr


def test_the_engine_children_start_before_the_heavy_imports() -> None:
    """The launcher spawns the engine's children before it imports torch and transformers, so
    that their start-up overlaps its imports (docs/architecture.md): what it imports to start
    them (every kind of child: schedulers, DP controller, detokenizer) must stay light."""
    code = (
        "import sys\n"
        "import sglang.launch_server\n"
        "from sglang.srt import server_args\n"
        "from sglang.srt.entrypoints import engine_processes\n"
        "server_args._GPU_DRIVER_PATHS = ('/nonexistent',)  # a host without a GPU driver\n"
        "args = server_args.ServerArgs(model_path='m', dp_size=2)\n"
        "engine_processes._engine_children(args)\n"
        "sys.stderr.write(args.device + ' HEAVY=' + str(sorted({'torch', 'transformers',"
        " 'fastapi'} & set(sys.modules))))\n"
    )
    result = _run_cli(code=code)
    assert "cpu HEAVY=[]" in result.stderr, result.stderr[-2000:]


def test_issue_flags_are_accepted() -> None:
    args = parse_server_args([
        "--model", "m", "--tokenizer-path", "t", "--host", "0.0.0.0", "--port", "1234",
        "--dtype", "float32", "--context-length", "256", "--mem-fraction-static", "0.5",
        "--max-total-tokens", "1024", "--max-running-requests", "4", "--max-prefill-tokens",
        "512", "--chunked-prefill-size", "128", "--page-size", "1", "--schedule-policy", "lpm",
        "--disable-radix-cache", "--attention-backend", "torch_native", "--sampling-backend",
        "pytorch", "--device", "cpu", "--random-seed", "7", "--api-key", "k",
        "--served-model-name", "name", "--skip-tokenizer-init", "--stream-interval", "2",
        "--log-level", "warning", "--log-requests", "--enable-deterministic-inference",
        "--trust-remote-code", "--tp-size", "1", "--skip-server-warmup", "--enable-metrics",
    ])
    assert args.model_path == "m" and args.port == 1234 and args.context_length == 256
    assert args.mem_fraction_static == 0.5 and args.schedule_policy == "lpm"
    assert args.disable_radix_cache and args.enable_metrics and args.skip_server_warmup
    assert args.random_seed == 7 and args.served_model_name == "name"


def test_defaults() -> None:
    args = parse_server_args(["--model-path", "m", "--device", "cpu"])
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    assert args.served_model_name == "m" and args.tokenizer_path == "m"
    assert args.api_key is None and not args.enable_metrics
    assert (args.attention_backend, args.sampling_backend) == ("torch_native", "pytorch")
    # on CUDA the paged Triton attention kernel and the fused Triton sampler
    cuda = parse_server_args(["--model-path", "m", "--device", "cuda"])
    assert (cuda.attention_backend, cuda.sampling_backend) == ("triton", "triton")


@pytest.mark.parametrize("argv, needle", [
    (["--model-path", "m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--port", "1"], "--model-path"),
    (["--model-path", "m", "--port", "abc"], "--port"),
    (["--model-path", "m", "--dtype", "int3"], "--dtype"),
])
def test_argparse_errors_exit_2(argv: list[str], needle: str,
                                capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--tp-size", "0"], "--tp-size"),
    (["--attention-backend", "flashinfer"], "--attention-backend flashinfer is not available"),
    (["--page-size", "0"], "--page-size"),
])
def test_values_we_cannot_honour_exit_2(argv: list[str], needle: str,
                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model-path", "m", "--device", "cpu", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_parallelism_error_from_the_real_command() -> None:
    result = _run_cli("--model-path", "m", "--device", "cpu", "--tp-size", "3", "--nnodes", "2",
                      "--dist-init-addr", "127.0.0.1:5000")
    assert result.returncode == 2
    assert "--tp-size 3 must be a multiple of --nnodes 2" in result.stderr


def test_server_args_doc_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_server_args_doc", REPO_ROOT / "scripts" / "gen_server_args_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (REPO_ROOT / "docs" / "server_args.md").read_text(encoding="utf-8")
    assert committed == module.render_markdown(), (
        "docs/server_args.md is stale: run python scripts/gen_server_args_doc.py "
        "--output docs/server_args.md"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cpu_bf16_linear": "x"},
        {"schedule_policy": "random"},
        {"disable_cpu_weight_prepack": "no"},
        {"disable_radix_cache": 1},
        {"enable_metrics": None},
        {"gc_threshold": []},
        {"gc_threshold": [700, 10, 10, 10]},
        {"gc_threshold": [-1]},
        {"gc_threshold": ["700"]},
        {"prefill_max_requests": 0},
        {"prefill_max_requests": "2"},
        {"prefill_max_requests": float("nan")},
        {"gc_threshold": [2**31]},
    ],
)
def test_keyword_flags_and_choices_are_checked(kwargs: dict) -> None:
    """What argparse guarantees on the command line holds for keyword arguments too (Engine):
    on/off fields are bools, fields with choices hold one of them."""
    name = next(iter(kwargs)).replace("_", "-")
    with pytest.raises(ValueError, match=f"--{name}"):
        ServerArgs(model_path="m", device="cpu", **kwargs)
