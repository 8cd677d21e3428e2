"""verl's server mode, with upstream's low-level launch API: ``_launch_subprocesses`` starts an
engine, ``set_global_state`` attaches it to the module-level ``http_server.app``, and the
framework serves that app with its own uvicorn server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import uvicorn
from server_test_utils import free_port

from sglang.srt.entrypoints import engine as engine_module
from sglang.srt.entrypoints.engine_processes import kill_engine_processes
from sglang.srt.entrypoints.http_server import (
    _GlobalState,
    _launch_subprocesses,
    app,
    set_global_state,
)
from sglang.srt.managers.tokenizer_manager import ServerStatus
from sglang.srt.server_args import ServerArgs


def test_foreign_process_function_is_refused_before_anything_starts(
    tiny_model_dir: Callable[..., Path],
) -> None:
    args = ServerArgs(model_path=str(tiny_model_dir()), device="cpu")
    with pytest.raises(ValueError, match="run_scheduler_process_func"):
        _launch_subprocesses(args, run_scheduler_process_func=lambda *a: None)


def test_verl_server_mode_serves_the_module_app(tiny_model_dir: Callable[..., Path]) -> None:
    args = ServerArgs(model_path=str(tiny_model_dir()), device="cpu", random_seed=0,
                      max_total_tokens=512)
    tokenizer_manager, template_manager, scheduler_info, *_ = _launch_subprocesses(
        server_args=args,
        init_tokenizer_manager_func=engine_module.init_tokenizer_manager,
        run_scheduler_process_func=engine_module.run_scheduler_process,
        run_detokenizer_process_func=engine_module.run_detokenizer_process,
    )
    processes = tokenizer_manager.watched_processes
    assert template_manager is None and scheduler_info["context_length"] > 0
    assert processes and all(p.is_alive() for p in processes)
    set_global_state(_GlobalState(tokenizer_manager=tokenizer_manager,
                                  template_manager=template_manager,
                                  scheduler_info=scheduler_info))
    with pytest.raises(RuntimeError, match="already"):
        set_global_state(_GlobalState(tokenizer_manager=tokenizer_manager))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as client:
            for _ in range(200):
                if server.started:
                    break
                threading.Event().wait(0.05)
            assert client.get("/health").status_code == 200
            params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
            first = client.post("/generate", json={"input_ids": [5, 6, 7],
                                                   "sampling_params": params}).json()
            assert first["meta_info"]["completion_tokens"] == 4
            assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            assert client.post("/continue_generation", json={}).status_code == 200
            assert client.post("/flush_cache").status_code == 200
            again = client.post("/generate", json={"input_ids": [5, 6, 7],
                                                   "sampling_params": params}).json()
            assert again["output_ids"] == first["output_ids"]
            tokenizer_manager.server_status = ServerStatus.UnHealthy
            assert client.get("/health").status_code == 503
            tokenizer_manager.server_status = ServerStatus.Up
            assert client.get("/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)
        kill_engine_processes(processes, tokenizer_manager.port_args)
    assert not any(p.is_alive() for p in processes)


def test_verl_0510_launch_returns_upstreams_tuple(tiny_model_dir: Callable[..., Path]) -> None:
    """From 0.5.10 on verl imports ``Engine`` from http_server and unpacks the classmethod's
    tuple as ``tokenizer_manager, template_manager, scheduler_info, *_`` (the third element is
    upstream's port args, which _GlobalState replaces by the scheduler info), then builds
    upstream's GenerateReqInput and awaits ``generate_request``."""
    from sglang.srt.entrypoints.http_server import Engine
    from sglang.srt.managers.io_struct import GenerateReqInput

    args = ServerArgs(model_path=str(tiny_model_dir()), device="cpu", random_seed=0,
                      max_total_tokens=512)
    tokenizer_manager, template_manager, port_args, init_result, watchdog = (
        Engine._launch_subprocesses(
            server_args=args,
            init_tokenizer_manager_func=engine_module.init_tokenizer_manager,
            run_scheduler_process_func=engine_module.run_scheduler_process,
            run_detokenizer_process_func=engine_module.run_detokenizer_process,
        ))
    processes = tokenizer_manager.watched_processes
    try:
        assert template_manager is None and watchdog is None
        assert port_args is tokenizer_manager.port_args
        assert init_result.scheduler_infos[0]["context_length"] > 0
        init_result.wait_for_ready()
        state = _GlobalState(tokenizer_manager=tokenizer_manager,
                             template_manager=template_manager, scheduler_info=port_args)
        assert state.scheduler_info == init_result.scheduler_infos[0]

        async def generate() -> dict:
            tokenizer_manager.start()
            request = GenerateReqInput(rid="verl-1", input_ids=[5, 6, 7], image_data=None,
                                       return_logprob=True, sampling_params={
                                           "temperature": 0, "max_new_tokens": 4,
                                           "ignore_eos": True})
            try:
                return await tokenizer_manager.generate_request(request, None).__anext__()
            finally:
                await tokenizer_manager.close()  # its sockets belong to this loop

        out = asyncio.run(generate())
        assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) == 4
    finally:
        kill_engine_processes(processes, tokenizer_manager.port_args)
    init_result.wait_for_completion()
    assert not any(p.is_alive() for p in processes)
    assert Engine.run_scheduler_process_func is engine_module.run_scheduler_process
