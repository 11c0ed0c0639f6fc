"""PagedKVCache, one decode step of a batch, phase by phase; and the memory
taken by creating a cache.

The calls that change the cache (extend, plan, release) run once per fresh
setup (``number = 1``); the others leave it as they found it.
"""

import numpy as np

from pagedkv_np import PagedKVCache

from . import BACKENDS, PAGE_SIZE, backend_or_skip, with_sync

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 2, 8, 64, "float16"
SYSTEM_LEN, USER_LEN = 256, 32


def _extend_all(cache, seqs):
    for seq in seqs:
        cache.extend(seq, [1])


def _release_all(cache, seqs):
    for seq in seqs:
        cache.release(seq)


def _write_layers(cache, plan, k, v):
    for layer in range(NUM_LAYERS):
        cache.write(layer, plan, k, v)


def _gather_layers(cache, plan, outs):
    for layer in range(NUM_LAYERS):
        cache.gather(layer, plan, "BHTD", out=outs[layer])


def _add_release(cache, prompt):
    cache.release(cache.add_sequence(prompt))


class DecodeStep:
    """``num_seqs`` sequences sharing a 256-token system prompt, each with 32
    tokens of its own, written; then one decode token each."""

    params = [BACKENDS, [1, 32]]
    param_names = ["backend", "num_seqs"]

    def setup(self, backend_name, num_seqs):
        backend = backend_or_skip(backend_name)
        rng = np.random.default_rng(0)
        seq_len = SYSTEM_LEN + USER_LEN + 1
        pages_per_seq = -(-seq_len // PAGE_SIZE)
        cache = PagedKVCache(NUM_LAYERS, (num_seqs + 1) * pages_per_seq, PAGE_SIZE,
                             NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, backend=backend,
                             hash_secret=b"pagedkv-asv")
        system = rng.integers(0, 50_000, SYSTEM_LEN)
        prompts = [np.concatenate([system, rng.integers(0, 50_000, USER_LEN)])
                   for _ in range(num_seqs)]
        seqs = []
        for prompt in prompts:
            seq = cache.add_sequence(prompt)
            cache.extend(seq, prompt[seq.num_cached_tokens:])
            plan = cache.plan([seq])
            k = backend.asarray(rng.standard_normal(
                (plan.num_new_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(DTYPE))
            _write_layers(cache, plan, k, k)
            seqs.append(seq)
        _extend_all(cache, seqs)
        self.cache, self.seqs, self.prompt = cache, seqs, prompts[0]
        self.tokens = np.ones(num_seqs, dtype=np.int64)
        self.plan = cache.plan(seqs)
        self.k = backend.asarray(rng.standard_normal(
            (num_seqs, NUM_KV_HEADS, HEAD_DIM)).astype(DTYPE))
        shape = (num_seqs, NUM_KV_HEADS, seq_len, HEAD_DIM)
        self.outs = [(backend.zeros(shape, cache.dtype), backend.zeros(shape, cache.dtype))
                     for _ in range(NUM_LAYERS)]
        self.write = with_sync(backend, lambda: _write_layers(cache, self.plan, self.k, self.k))
        self.gather = with_sync(backend, lambda: _gather_layers(cache, self.plan, self.outs))
        self.write()  # warm-up: JIT compilation, first touch of the buffers
        self.gather()

    def time_add_sequence_release(self, *params):
        _add_release(self.cache, self.prompt)

    def time_extend(self, *params):
        _extend_all(self.cache, self.seqs)

    time_extend.number = 1

    def time_extend_batch(self, *params):
        self.cache.extend_batch(self.seqs, self.tokens)

    time_extend_batch.number = 1

    def time_plan(self, *params):
        self.cache.plan(self.seqs)

    time_plan.number = 1

    def time_write(self, *params):
        self.write()

    def time_gather(self, *params):
        self.gather()

    def time_release(self, *params):
        _release_all(self.cache, self.seqs)

    time_release.number = 1


class CreateCache:
    """Peak memory of creating a cache (1 layer, 1 x 64 float16 per token);
    the store is zero-filled lazily, so this is mostly the pool and index."""

    params = [[1024, 16384, 262144]]
    param_names = ["num_pages"]

    def peakmem_create(self, num_pages):
        PagedKVCache(1, num_pages, PAGE_SIZE, 1, 64, dtype="float16", backend="numpy")
