"""``python -m sglang.launch_server --model-path ...``: serve a model over HTTP.

Every flag comes from a field of :class:`ServerArgs` (``--help`` lists them). ``--help`` and
argument errors are handled before anything heavy (torch, the model) is imported. Values we
accept but cannot honour (e.g. ``--tp-size 3 --nnodes 2``) exit with status 2 and a message
naming the flag, like any other argparse error. Upstream SGLang's other flags are accepted too
(hidden from ``--help``), as are upstream's spellings (``--tensor-parallel-size``) and backend
names (``--attention-backend fa3`` falls back to this build's default): see
docs/compatibility.md for which ones are ignored and which are refused. With ``--node-rank``
> 0 (multi-node) the command runs that node's tensor-parallel ranks only, without HTTP, until
they exit (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import signal
import sys

from sglang.srt.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the server, generated from the ServerArgs fields (upstream-only
    ones hidden from ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang.launch_server",
        description="Serve a language model with SGLang's native and OpenAI-compatible HTTP "
        "APIs.",
    )
    ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    """ServerArgs from the command line; exits with status 2 on any invalid flag or value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def run_server(server_args: ServerArgs) -> None:
    """Serve HTTP until interrupted (upstream's name for ``http_server.launch_server``)."""
    from sglang.srt.entrypoints.http_server import launch_server

    launch_server(server_args)


def main(argv: list[str] | None = None) -> None:
    server_args = parse_server_args(argv)
    starting = None
    if server_args.node_rank == 0:
        # The engine's children start before the HTTP stack (torch, transformers, FastAPI) is
        # imported here, so that their start-up and these imports overlap.
        from sglang.srt.entrypoints.engine_processes import exit_on_signal, start_engine_children

        # Until the server installs its own handler, SIGTERM stops the children started so far
        # and removes the IPC directory (the default action would leave them to notice the
        # launcher's death, and the directory behind): by unwinding while they are spawned,
        # then from the handler itself.
        signal.signal(signal.SIGTERM, exit_on_signal)
        starting = start_engine_children(server_args)
        starting.kill_on_sigterm()
    try:
        from sglang.srt.entrypoints.http_server import launch_server
    except BaseException:
        if starting is not None:
            starting.kill()
        raise
    launch_server(server_args, starting)


if __name__ == "__main__":
    main(sys.argv[1:])
