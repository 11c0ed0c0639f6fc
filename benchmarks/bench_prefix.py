"""The prefix index: lookup throughput, and the hit rate of a workload whose
requests share a system prompt."""

import numpy as np

from pagedkv_np import PagedKVCache
from pagedkv_np.prefix import PrefixIndex

from . import PAGE_SIZE, best_times, memo


def index_with_prompt(num_tokens):
    """An index holding every full page of one prompt; that prompt's bytes
    (a hit on every page) and a prompt differing in its first token (a miss
    on the first page)."""
    index = PrefixIndex(PAGE_SIZE, secret=b"pagedkv-asv")
    tokens = np.random.default_rng(0).integers(0, 50_000, num_tokens).astype("<i8")
    hit = tokens.tobytes()
    digest, parent = index.root()
    step = 8 * PAGE_SIZE
    for page_id in range(num_tokens // PAGE_SIZE):
        chunk = hit[page_id * step:(page_id + 1) * step]
        digest = index.page_digest(digest, chunk)
        index.register(page_id, digest, chunk, parent)
        parent = index.identity(page_id)
    tokens[0] += 1
    return index, hit, tokens.tobytes()


class Lookup:
    params = [[256, 4096, 32768], ["hit", "miss"]]
    param_names = ["num_tokens", "outcome"]
    repeat = (20, 500, 1.0)  # one call per sample under recent asv_runner

    def setup(self, num_tokens, outcome):
        index, hit, miss = memo(("Lookup", num_tokens), lambda: index_with_prompt(num_tokens))
        tokens = hit if outcome == "hit" else miss
        max_pages = (num_tokens - 1) // PAGE_SIZE  # the last token is always recomputed
        self.lookup = lambda: index.lookup(tokens, num_tokens, max_pages, count=False)

    def time_lookup(self, num_tokens, outcome):
        self.lookup()

    def track_tokens_per_second(self, num_tokens, outcome):
        return num_tokens / best_times([self.lookup])[0]

    track_tokens_per_second.unit = "tokens/s"


def shared_prompt_workload(num_requests=32, system_len=1000, num_pages=256, seed=0):
    """Requests of a system prompt plus a user message of 50-300 tokens and 16
    generated tokens, one after another, through a cache of ``num_pages``
    pages (4096 tokens): user pages are evicted, the system prompt's stay hot.
    Returns the cache's prefix hit rate."""
    rng = np.random.default_rng(seed)
    cache = PagedKVCache(1, num_pages, PAGE_SIZE, 1, 8, backend="numpy",
                         hash_secret=b"pagedkv-asv")
    kv = np.zeros((system_len + 300, 1, 8), dtype=np.float32)

    def step(seq):  # pages are shared only once their K/V is written
        plan = cache.plan([seq])
        cache.write(0, plan, kv[:plan.num_new_tokens], kv[:plan.num_new_tokens])

    system = rng.integers(0, 50_000, system_len)
    for _ in range(num_requests):
        prompt = np.concatenate([system, rng.integers(0, 50_000, rng.integers(50, 301))])
        seq = cache.add_sequence(prompt)
        cache.extend(seq, prompt[seq.num_cached_tokens:])
        step(seq)
        for token in rng.integers(0, 50_000, 16):
            cache.extend(seq, [int(token)])
            step(seq)
        cache.release(seq)
    return cache.stats.prefix_hit_rate


class SharedSystemPrompt:
    def track_prefix_hit_rate(self):
        return shared_prompt_workload()

    track_prefix_hit_rate.unit = "hit tokens / prompt tokens"
