"""The seed-compatible API: recording the pages of one long sequence page by
page, the way a seed caller does after each page fills.

``time_record_page`` records the last full page of a sequence whose earlier
pages are recorded; its cost per call should not grow with the sequence.
"""

import numpy as np

from pagedkv_np import PagedCache

from . import PAGE_SIZE, memo


def recorded_sequence(num_tokens, kind):
    """A cache holding every full page but the last of one sequence, recorded
    page by page, and the sequence as the caller keeps it (a list of ints or
    an int64 array)."""
    num_pages = num_tokens // PAGE_SIZE
    cache = PagedCache(1, num_pages, PAGE_SIZE, 1, 1, backend="numpy",
                       hash_secret=b"pagedkv-asv")
    ids = np.random.default_rng(0).integers(0, 50_000, num_tokens)
    tokens = ids.tolist() if kind == "list" else ids.astype(np.int64)
    pages = cache.alloc_n(num_pages)
    for i, page_id in enumerate(pages[:-1]):
        cache.record_page(page_id, tokens, i)
    return cache, tokens, pages[-1]


class RecordPage:
    params = [[2048, 32768], ["list", "ndarray"]]
    param_names = ["num_tokens", "kind"]
    repeat = (20, 200, 1.0)
    # Building the 32K-token chain once takes seconds on a quadratic record_page.
    timeout = 300

    def setup(self, num_tokens, kind):
        cache, tokens, last_page = memo(("RecordPage", num_tokens, kind),
                                        lambda: recorded_sequence(num_tokens, kind))
        logical = num_tokens // PAGE_SIZE - 1
        # Recording a recorded page again changes nothing: each call does the
        # whole work of the first one, so samples need no fresh state.
        self.record = lambda: cache.record_page(last_page, tokens, logical)

    def time_record_page(self, num_tokens, kind):
        self.record()
