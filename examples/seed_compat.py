"""Coming from the seed's API: ``PagedCache`` and ``CacheView`` on NumPy arrays.

The seed design (a PyTorch paged cache) drove its cache by hand: allocate
pages, bind a page table, write and gather through a view, record full pages
in the prefix index, look a prefix up for the next request and take
references on the pages it reuses. ``pagedkv_np.PagedCache`` keeps those
method names on NumPy arrays, with the seed's flaws fixed: prefix hashes are
chained and every hit is checked against the stored tokens, a double free
raises, ``alloc_n`` is all or nothing, ``gather`` zero-fills past a row's
length. The K/V here are made up; a real loop takes them from the model.
New code should prefer ``PagedKVCache``, which tracks sequences itself.

Run: python examples/seed_compat.py
"""

import numpy as np

from pagedkv_np import PagedCache, PageStateError

N_LAYERS, N_PAGES, PAGE_SIZE, N_KV_HEADS, HEAD_DIM = 2, 16, 4, 2, 8


def fake_kv(num_tokens: int, seed: int) -> np.ndarray:
    """[1, num_tokens, n_kv_heads, head_dim] of made-up K (or V)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, num_tokens, N_KV_HEADS, HEAD_DIM)).astype(np.float32)


def main() -> None:
    cache = PagedCache(N_LAYERS, N_PAGES, PAGE_SIZE, N_KV_HEADS, HEAD_DIM, dtype="float32")
    system = [101, 102, 103, 104, 105, 106, 107, 108]     # two full pages of a system prompt

    # request 1: nothing cached, so allocate every page and compute every token
    prompt = system + [1, 2]
    pages = cache.alloc_n(3)                               # all three or none
    view = cache.bind(np.array([pages]), total_len=len(prompt))
    k, v = fake_kv(len(prompt), 0), fake_kv(len(prompt), 1)
    for layer in range(N_LAYERS):
        view.write(layer, 0, k, v)                         # [B, T, heads, dim] from position 0
    k_all, _ = view.gather(0)                              # [1, len(prompt), heads, dim]
    assert np.array_equal(k_all, k)
    for logical, page in enumerate(pages[:2]):             # full pages only, in order
        cache.record_page(page, prompt, logical)
    print("request 1: pages", pages, "computed", len(prompt), "tokens")
    for page in pages:
        cache.free(page)                                   # recorded pages stay cached

    # request 2: the same system prompt, another question
    prompt = system + [3, 4, 5]
    cached = cache.lookup_prefix(prompt)                   # the system prompt's two pages
    for page in cached:
        cache.inc_ref(page)                                # keep them while we use them
    pages = cached + cache.alloc_n(1)
    start = len(cached) * PAGE_SIZE
    view = cache.bind(np.array([pages]), total_len=len(prompt))
    k_new = fake_kv(len(prompt) - start, 2)
    for layer in range(N_LAYERS):
        view.write(layer, start, k_new, k_new)             # only the uncached tokens
    k_all, _ = view.gather(0)
    assert np.array_equal(k_all[0, :start], k[0, :start])  # the reused system prompt
    print("request 2: pages", pages, "reused", start, "tokens, computed",
          len(prompt) - start, "| lookup hits", cache.lookup_hits, "misses", cache.lookup_misses)
    for page in pages:
        cache.free(page)

    # one of the seed's flaws, fixed: a second free of the same page is refused
    try:
        cache.free(pages[-1])
    except PageStateError as exc:
        print("double free refused:", exc)


if __name__ == "__main__":
    main()
