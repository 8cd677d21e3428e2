"""A clean exit of the HTTP server (docs/security.md).

On SIGTERM or SIGINT, uvicorn stops accepting connections and waits a few seconds for the
open ones before cancelling them, which would answer an unfinished request with a bare 500.
:class:`GracefulServer` first fails every in-flight request through the TokenizerManager, so
each caller gets a 503 with a JSON error body (a stream: a final error event, then
``[DONE]``), and only then lets uvicorn drain the connections. ``launch_server`` removes the
IPC directory after the engine processes are gone.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down"


class GracefulServer(uvicorn.Server):
    """uvicorn's server that fails in-flight requests (503) before draining connections.

    ``tokenizer_manager`` is anything with ``async close(reason)`` failing every pending call
    with ``RuntimeError(reason)``.
    """

    def __init__(self, config: uvicorn.Config, tokenizer_manager: Any) -> None:
        super().__init__(config)
        self.tokenizer_manager = tokenizer_manager

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Fail the in-flight requests, then uvicorn's shutdown (drain, lifespan end)."""
        try:
            await self.tokenizer_manager.close(SHUTDOWN_MESSAGE)
        except Exception:  # the shutdown goes on whatever happened to the engine
            logger.warning("Failing the in-flight requests at shutdown failed", exc_info=True)
        await super().shutdown(sockets)
