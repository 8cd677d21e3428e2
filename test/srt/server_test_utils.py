"""Run ``python -m sglang.launch_server`` in a subprocess on a free port, for HTTP tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0
_PORT_ATTEMPTS = 3
# One HTTP client for the test helpers (thread-safe; no cap on connections, so concurrent callers
# never wait on its pool). A module-level ``httpx.get``/``httpx.post`` builds a client per call,
# and each loads the CA bundle into a new SSL context: ~26 ms of CPU a request, which the polling
# loops (a starting server's /health every 0.2 s, on the cores it starts on) and the fuzz tests
# paid on every call.
HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
# On a GPU an engine sizes its KV pool from the free memory, so test modules run side by side
# (pytest -n) would starve one another; a fixed pool lets them share the device. Servers take it
# unless their arguments name a pool size.
CUDA_POOL_TOKENS: int | None = 65536 if torch.cuda.is_available() else None


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs: a zombie (exited, not yet reaped) or a vanished pid is not
    alive, and a process that exits while it is being looked at counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess; ``url`` is its base URL. Use as a context manager: entering waits
    until /health answers 200 (raising with the server's log if it dies or times out; a port
    taken meanwhile by another process is retried on a new port), leaving stops it (SIGTERM,
    then SIGKILL) and with it the engine processes."""

    def __init__(self, model_path: str | Path, *extra_args: str,
                 api_key: str | None = None) -> None:
        self.api_key = api_key
        self.base_args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            *extra_args, *(["--api-key", api_key] if api_key else []),
        ]
        if CUDA_POOL_TOKENS and not any(a.startswith("--max-total-tokens") for a in extra_args):
            self.base_args += ["--max-total-tokens", str(CUDA_POOL_TOKENS)]
        self.port = 0
        self.url = ""
        self.log_path = Path(tempfile.mkdtemp(prefix="sglang-server-")) / "server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> ServerProcess:
        for _ in range(_PORT_ATTEMPTS):
            if self._start():
                return self
        raise RuntimeError(f"no free port found:\n{self.output()}")

    def _start(self) -> bool:
        """Launch on a fresh port; True once healthy, False if the port was taken."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        paths = [str(REPO_ROOT / "python"), str(REPO_ROOT / "sgl-kernel" / "python")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*self.base_args, "--port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + STARTUP_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.output():
                    return False
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if HTTP.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.output()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]


@contextlib.contextmanager
def started_together(*servers: ServerProcess) -> Iterator[list[ServerProcess]]:
    """Enter ``servers`` concurrently (a start is mostly single-threaded imports, so two share
    the cores better than they follow each other) and leave them all at the end. When one
    fails to start, the ones that started are stopped and its error is raised."""
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(server.__enter__) for server in servers]
        for server, future in zip(servers, futures):
            if future.exception() is None:
                stack.push(server.__exit__)
        for future in futures:
            future.result()  # the first failure, after every started server is registered
        yield list(servers)
