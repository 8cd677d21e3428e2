"""The import surface RL frameworks use (docs/compatibility.md): upstream's names, signatures
and behaviour, without starting an engine."""

from __future__ import annotations

import base64
import logging
import os
import pickle
import resource
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

import sglang
from sglang.srt.server_args import prepare_server_args
from sglang.srt.server_args_upstream import server_args_from_kwargs
from sglang.srt.utils import (
    MultiprocessingSerializer,
    assert_pkg_version,
    is_cuda,
    kill_process_tree,
    maybe_set_triton_cache_manager,
    set_prometheus_multiproc_dir,
    set_ulimit,
)
from sglang.srt.utils.multiprocessing_serializer import decode_named_tensors


def test_version_states_upstream_api_level_and_local_label() -> None:
    v = Version(sglang.__version__)
    assert v.local == "interruptible"
    assert Version(v.public) >= Version("0.5.10.post1")  # AReaL's gate
    assert v.public == sglang.version.UPSTREAM_API_VERSION


def test_skyrl_engine_imports_resolve() -> None:
    from sglang.srt.managers.tokenizer_manager import (
        InitWeightsUpdateGroupReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
        UpdateWeightsFromDistributedReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=["x"], flush_cache=False)
    assert obj.serialized_named_tensors == ["x"] and obj.flush_cache is False
    assert InitWeightsUpdateGroupReqInput("h", 1, 1, 2).group_name == "weight_update_group"
    assert UpdateWeightsFromDistributedReqInput(name="w", dtype="float32", shape=[2]).name == "w"
    assert ReleaseMemoryOccupationReqInput(tags=["kv_cache"]).tags == ["kv_cache"]
    assert ResumeMemoryOccupationReqInput().tags is None


def test_serializer_round_trips_cpu_tensors_by_value() -> None:
    named = [
        ("bf16", torch.randn(3, 4, dtype=torch.bfloat16)),
        ("view", torch.arange(10)[2:5]),  # a view: only its elements travel
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 3)),
    ]
    payload = MultiprocessingSerializer.serialize(named, output_str=True)
    assert isinstance(payload, str)
    out = decode_named_tensors([payload])
    for (name, got), (_, want) in zip(out, named, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    raw = MultiprocessingSerializer.serialize(named)
    assert isinstance(raw, bytes) and len(raw) < 1000
    assert torch.equal(MultiprocessingSerializer.deserialize(raw)[1][1], torch.tensor([2, 3, 4]))


def test_serializer_refuses_code_and_garbage() -> None:
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        MultiprocessingSerializer.deserialize(evil)
    with pytest.raises(ValueError, match="base64"):
        MultiprocessingSerializer.deserialize("not base64!")
    with pytest.raises(ValueError, match=r"serialized_named_tensors\[0\]"):
        decode_named_tensors([MultiprocessingSerializer.serialize({"a": 1}, output_str=True)])
    with pytest.raises(ValueError, match="rank 0"):
        decode_named_tensors([])


def test_kill_process_tree_keeps_the_parent_when_asked() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kill_process_tree(os.getpid(), include_parent=False)
        assert child.wait(timeout=10) == -9
    finally:
        if child.poll() is None:
            child.kill()
    kill_process_tree(child.pid)  # gone already: nothing to do, no error


def test_process_setup_helpers() -> None:
    set_ulimit(256)  # never lowers the limit
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == resource.RLIM_INFINITY or soft >= 256
    assert is_cuda() == torch.cuda.is_available()
    assert_pkg_version("torch", "2.0", "")
    with pytest.raises(RuntimeError, match="less than the minimum required version 99"):
        assert_pkg_version("torch", "99", "upgrade it")
    with pytest.raises(RuntimeError, match="not installed"):
        assert_pkg_version("no-such-package-xyz", "1.0", "")
    maybe_set_triton_cache_manager()  # triton >= 3 here: nothing to change


def test_port_and_address_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's rollout imports get_open_port / get_ip from sglang.srt.utils (older upstream)
    and from sglang.srt.utils.network (newer)."""
    import socket

    from sglang.srt.utils import get_ip, get_local_ip_auto, get_open_port
    from sglang.srt.utils.network import get_free_port

    for port in (get_open_port(), get_free_port()):
        with socket.socket() as sock:
            sock.bind(("", port))  # free when returned
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setenv("SGLANG_PORT", str(busy))
        assert get_open_port() > busy  # the first free one from $SGLANG_PORT upwards
    monkeypatch.setenv("SGLANG_HOST_IP", "10.1.2.3")
    assert get_ip() == get_local_ip_auto() == "10.1.2.3"
    monkeypatch.delenv("SGLANG_HOST_IP")
    monkeypatch.delenv("HOST_IP", raising=False)
    socket.inet_pton(socket.AF_INET6 if ":" in get_ip() else socket.AF_INET, get_ip())


def test_set_prometheus_multiproc_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    path = set_prometheus_multiproc_dir()
    assert os.path.isdir(path) and os.environ["PROMETHEUS_MULTIPROC_DIR"] == path
    assert set_prometheus_multiproc_dir() == path  # an existing setting is kept


def test_upstream_kwargs_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        args = server_args_from_kwargs({
            "model_path": "m", "device": "cpu", "mm_attention_backend": "fa3",
            "enable_memory_saver": True, "custom_weight_loader": ["pkg.loader"], "moe_dp_size": 1,
            "quantization": None, "json_model_override_args": "{}", "attention_backend": "fa3",
        })
    assert args.custom_weight_loader == ["pkg.loader"]
    assert args.attention_backend == "torch_native"  # this build's default on CPU
    assert args.enable_memory_saver is True  # read back as passed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for name in ("mm_attention_backend", "enable_memory_saver", "attention_backend"):
        assert name in warnings[0]
    assert "moe_dp_size" not in warnings[0]  # upstream's default: nothing to say


def test_upstream_kwargs_that_change_results_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2'.*quantization='fp8'"):
        server_args_from_kwargs({"model_path": "m", "quantization": "fp8",
                                 "kv_cache_dtype": "fp8_e5m2"})
    with pytest.raises(TypeError, match="no_such_option, other_unknown"):
        server_args_from_kwargs({"model_path": "m", "no_such_option": 1, "other_unknown": 2})


def test_prepare_server_args_takes_upstream_flags(capsys: pytest.CaptureFixture) -> None:
    args = prepare_server_args([
        "--model-path", "m", "--device", "cpu", "--disable-cuda-graph", "--dp-size", "1",
        "--cuda-graph-bs", "1", "2", "--tool-call-parser", "qwen25",
    ])
    assert (args.model_path, args.tool_call_parser) == ("m", "qwen25")
    with pytest.raises(SystemExit) as exit_info:
        prepare_server_args(["--model-path", "m", "--device", "cpu", "--quantization", "fp8"])
    assert exit_info.value.code == 2
    assert "quantization='fp8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--no-such-flag"])
