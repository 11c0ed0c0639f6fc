"""Prefix reuse across requests that share a system prompt.

Each request's K/V is made up here (a real loop takes it from the model);
what matters is which tokens the cache serves and which it asks to compute.
Run: python examples/prefix_reuse.py
"""

import numpy as np

from pagedkv_np import PagedKVCache

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 8


def fake_kv(tokens, positions):
    """Deterministic stand-in for a model's K/V of ``tokens`` at ``positions``."""
    base = (np.asarray(tokens) * 1000 + np.asarray(positions)).astype(np.float32)
    return np.broadcast_to(base[:, None, None], (len(tokens), NUM_KV_HEADS, HEAD_DIM)).copy()


def serve(cache, prompt, salt=None):
    seq = cache.add_sequence(prompt, salt=salt)
    start = seq.num_cached_tokens
    new = prompt[start:]
    cache.extend(seq, new)
    plan = cache.plan([seq])
    kv = fake_kv(new, np.arange(start, len(prompt)))
    for layer in range(NUM_LAYERS):
        cache.write(layer, plan, kv, -kv)
        k, v = cache.gather(layer, plan, layout="BHTD")
    # The gathered K holds every prompt token, cached or new, in order.
    assert np.array_equal(k[0, 0, :, 0], fake_kv(prompt, np.arange(len(prompt)))[:, 0, 0])
    cache.release(seq)
    return start


def main():
    # HND pages keep each head's positions together, as the BHTD gathers below want
    cache = PagedKVCache(NUM_LAYERS, 64, 16, NUM_KV_HEADS, HEAD_DIM, dtype="float32",
                         layout="HND")
    system = list(range(500, 548))  # a 48-token system prompt
    questions = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    for i, question in enumerate(questions):
        cached = serve(cache, system + question)
        print(f"request {i}: {len(system) + len(question):3d} prompt tokens, "
              f"{cached:3d} served from the cache")
    cached = serve(cache, system + [1, 2, 3], salt="tenant-b")
    print(f"other tenant (salted): {cached} served from the cache")
    stats = cache.stats
    print(f"backend={cache.backend.name} pages used={stats.pages_used} "
          f"evictable={stats.pages_evictable} free={stats.pages_free} "
          f"prefix hit rate={stats.prefix_hit_rate:.1%} "
          f"({stats.prefix_hit_tokens}/{stats.prefix_query_tokens} tokens)")


if __name__ == "__main__":
    main()
