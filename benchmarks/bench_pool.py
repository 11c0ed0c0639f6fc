"""The page pool: an alloc+free pair must cost the same at any pool size."""

from pagedkv_np.pool import PagePool

from . import best_times, memo

POOL_SIZES = [1 << 10, 1 << 16, 1 << 20]


def pool_cycle(num_pages, source):
    """A pool and one alloc+free pair that leaves it as it found it.

    ``"free"``: half the pages are in use and the page comes off the free
    list. ``"evict"``: every page is cached and evictable, so the page is
    evicted from the head of the LRU; marking it cached again before the free
    sends it back to the tail.
    """
    pool = PagePool(num_pages)
    if source == "free":
        pool.allocate(num_pages // 2)

        def cycle():
            pool.free(pool.allocate(1))
    else:
        pages = pool.allocate(num_pages)
        for page_id in pages:
            pool.mark_cached(page_id)
        pool.free(pages)

        def cycle():
            pages = pool.allocate(1)
            pool.mark_cached(pages[0])
            pool.free(pages)
    # Warm-up: the first append after the setup's pops resizes the free list.
    cycle()
    return cycle


class AllocFree:
    params = [POOL_SIZES, ["free", "evict"]]
    param_names = ["num_pages", "source"]
    # Calls of a few microseconds, one per sample under recent asv_runner
    # (which re-runs setup before every call): many samples make the median
    # steady, but it includes timeit's per-call overhead. The flatness check
    # is AllocFreeScaling, timed in loops.
    repeat = (50, 2000, 1.0)

    def setup(self, num_pages, source):
        self.cycle = memo(("AllocFree", num_pages, source), lambda: pool_cycle(num_pages, source))

    def time_alloc_free(self, num_pages, source):
        self.cycle()


class AllocFreeScaling:
    """Time of a pair at 1M pages over its time at 1K pages (1.0 = flat)."""

    params = [["free", "evict"]]
    param_names = ["source"]

    def setup(self, source):
        self.small = pool_cycle(POOL_SIZES[0], source)
        self.large = pool_cycle(POOL_SIZES[-1], source)

    def track_ratio_1m_to_1k(self, source):
        small, large = best_times([self.small, self.large], repeat=5, min_time=0.02)
        return large / small

    track_ratio_1m_to_1k.unit = "ratio"
