"""``pagedkv bench``: how fast pagedkv_np moves K/V, per backend and dtype.

Every bandwidth figure counts bytes read plus bytes written, and comes with
the bandwidth of a plain copy of the same number of bytes measured in the
same process (``copy GB/s``): the better of ``np.copyto`` on one thread and
on two threads (two halves copied at once; NumPy releases the GIL while it
copies), since a backend may use both cores too. ``x copy`` is the ratio of
the two: 1.0 is as fast as a plain copy. Times are the best of several
rounds of ``time.perf_counter``, after a warm-up call that keeps JIT
compilation and first-touch page faults out of the figures; each round
times the operation and its copies back to back. ``median`` is the median
over rounds of the ratio within one round, which a burst of load (or of
bandwidth) in a single round hardly moves.

Standard cases, run by default (the project's published figures)::

    gather         32 sequences x 2048 tokens, 8 KV heads x 128, one layer,
                   NHD store -> preallocated BHTD and BTHD buffers, and
                   HND store -> BHTD (plus a sweep over batch size, NHD ->
                   BHTD, for --plot)
    prefill_write  2048 tokens of one sequence (8 x 128), one layer
    decode_write   32 sequences x 1 token, one layer, per call of
                   PagedKVCache.write (Python overhead included)
    (both writes also ", fresh" on the host: a different destination each
    call, round and round through 64 MiB, beside a copy that does the same,
    since writes in serving go to new pages; decode_write then calls the
    backend's write)
    copy_pages     256 copy-on-write page pairs, 2 layers
    alloc_free     PagePool.allocate(1) + free at 1K, 64K and 1M pages
    prefix_lookup  PrefixIndex.lookup throughput in tokens/s, hit and miss

``gather``, ``prefill_write`` and ``copy_pages`` call the backend on arrays
laid out like the cache's store, with ``check_indices=False`` as the cache
calls them; pages are in a shuffled order, as after a while of serving.
``decode_write`` goes through :meth:`PagedKVCache.write`, whose overhead is
most of a decode step. ``alloc_free`` and ``prefix_lookup`` do not depend on
the backend or dtype (those fields are null).

Modules: :mod:`.timing` (interleaved timing rounds, the copy baseline),
:mod:`.cases` (the cases and :func:`run_benchmarks`), :mod:`.report` (the
table and the plot); this one holds the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from .ops import DATA_OPS, DEFAULT_DTYPES, OPS

__all__ = ["OPS", "run_benchmarks", "format_table", "plot_gather", "copy_bandwidth", "main"]

# Every public name of ``pagedkv bench`` is importable from the package itself,
# on first use (PEP 562): ``pagedkv bench --help`` imports no NumPy.
_LAZY = {name: ".cases" for name in (
    "FIELDS", "GATHER_SEQS", "GATHER_TOKENS", "HEAD_DIM", "NUM_KV_HEADS", "PAGE_SIZE",
    "POOL_SIZES", "pool_cycle", "prefix_setup", "run_benchmarks")}
_LAZY.update({name: ".report" for name in (
    "format_header", "format_row", "format_table", "import_pyplot", "plot_gather")})
_LAZY.update({name: ".timing" for name in ("best_times", "copy_bandwidth")})

if TYPE_CHECKING:
    from .cases import (
        FIELDS, GATHER_SEQS, GATHER_TOKENS, HEAD_DIM, NUM_KV_HEADS, PAGE_SIZE, POOL_SIZES,
        pool_cycle, prefix_setup, run_benchmarks)
    from .report import format_header, format_row, format_table, import_pyplot, plot_gather
    from .timing import best_times, copy_bandwidth


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv_np.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv bench",
        description="Time pagedkv_np's operations per backend and dtype, beside a plain "
                    "copy of the same bytes measured in the same process. A full run takes "
                    "about a minute on 2 cores; --quick about 15 s.")
    parser.add_argument("--quick", action="store_true",
                        help="a seconds-long smoke run (default: the full run)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of records instead of the table "
                             "(default: the table)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw gather bandwidth against batch size (needs matplotlib: "
                             "the plot extra; default: no plot)")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend(s) to run, repeatable or comma-separated: numpy, numba, "
                             "cupy (default: every available one)")
    parser.add_argument("--dtype", action="append", metavar="NAME",
                        help="dtype(s) of the data cases, repeatable or comma-separated "
                             f"(default: {','.join(DEFAULT_DTYPES)})")
    parser.add_argument("--op", action="append", metavar="NAME",
                        help=f"operation(s) to run, repeatable or comma-separated, from: "
                             f"{', '.join(OPS)} (default: all; {', '.join(DATA_OPS)} run per "
                             "backend and dtype)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv bench``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)

    import numpy as np

    from ..backends import available_backends, get_backend
    from ..errors import BackendUnavailable, ConfigError, DTypeError
    from ..layout import resolve_dtype
    from .cases import run_benchmarks
    from .report import format_header, format_row, import_pyplot, plot_gather

    ops = _split(args.op)
    for op in ops or ():
        if op not in OPS:
            parser.error(f"argument --op: unknown operation {op!r}; choose from {', '.join(OPS)}")
    backends = _split(args.backend)
    skipped: list[str] = []
    if backends is None:
        backends = available_backends()
        for name in ("numpy", "numba", "cupy"):
            if name not in backends:
                try:
                    get_backend(name)
                except BackendUnavailable as exc:
                    skipped.append(str(exc))
    for name in backends:
        try:
            get_backend(name)
        except (ConfigError, BackendUnavailable) as exc:
            parser.error(f"argument --backend: {exc}")
    dtypes = _split(args.dtype)
    for name in dtypes or ():
        try:
            resolve_dtype(name)
        except DTypeError as exc:
            parser.error(f"argument --dtype: {exc}")
    for flag, names in (("--op", ops), ("--backend", backends), ("--dtype", dtypes)):
        if names == []:
            parser.error(f"argument {flag}: expected at least one name")
    if args.plot:
        if ops is not None and "gather" not in ops:
            parser.error("argument --plot: the plot shows gather; add --op gather")
        try:
            import_pyplot()
        except ImportError as exc:
            parser.error(str(exc))
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            parser.error(f"argument --plot: no such directory for {args.plot!r}")

    out = sys.stdout
    if args.json:
        for reason in skipped:
            print(f"skipped: {reason}", file=sys.stderr)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"pagedkv bench{' --quick' if args.quick else ''}: numpy {np.__version__}, "
              f"{cpus} CPU(s). copy GB/s: best of np.copyto on 1 and 2 threads over the same "
              "bytes, in this process; x copy = GB/s / copy GB/s, each the best of its rounds; "
              "median = the median over rounds of that ratio within a round.", file=out)
        for reason in skipped:
            print(f"skipped: {reason}", file=out)
        print(format_header(), file=out, flush=True)
    on_record = None if args.json else (lambda rec: print(format_row(rec), file=out, flush=True))
    records = run_benchmarks(ops, backends, dtypes, args.quick, on_record)
    if args.json:
        json.dump(records, out, indent=1)
        out.write("\n")
    if args.plot:  # the checks above guarantee gather records
        plot_gather(records, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0

