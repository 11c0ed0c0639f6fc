"""Fuzz the public API of pagedkv_np for a time budget.

Runs the Hypothesis state machine of ``tests/test_fuzz.py`` (random sequences
of calls, often with invalid arguments; see that module) in small batches of
fresh random examples until the budget is spent. A failing example is
reported once per distinct failure and the search goes on, so one run
surveys every bug it can reach.

Usage::

    python scripts/fuzz.py --seconds 60

Prints the number of examples and calls run and the distinct failures
found; exits with status 1 if there was any.
"""

from __future__ import annotations

import argparse
import builtins
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_fuzz import BACKENDS, ApiFuzz, run_fuzz  # noqa: E402

BATCH = 5  # examples per batch: bounds the overrun of the budget to about a second


def _innermost(exc: BaseException) -> BaseException:
    """The exception a failing example raised (inside Hypothesis' groups)."""
    groups = getattr(builtins, "BaseExceptionGroup", ())   # Python 3.11+
    while isinstance(exc, groups) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _signature(exc: BaseException) -> str:
    """A key that is the same for every occurrence of one bug."""
    first_line = (str(exc).splitlines() or [""])[0]
    cause = exc.__cause__
    where = ""
    frames = traceback.extract_tb((cause or exc).__traceback__)
    for frame in reversed(frames):
        if "pagedkv_np" in frame.filename:
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            break
    # One entry per method for accepted invalid calls, whatever the arguments.
    text = re.sub(r"(accepted: \w+)\(.*", r"\1(...)", first_line)
    text = re.sub(r"\d+", "N", text)
    return f"{type(exc).__name__}: {text[:160]} [{where or 'tests/test_fuzz.py'}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    parser.add_argument("--verbose", action="store_true",
                        help="print each failing example's steps, not only its first line")
    args = parser.parse_args(argv)

    failures: dict[str, int] = {}
    start = time.perf_counter()
    deadline = start + args.seconds
    while time.perf_counter() < deadline:
        try:
            run_fuzz(max_examples=BATCH)
        except Exception as exc:  # a failing example: record it and go on
            inner = _innermost(exc)
            key = _signature(inner)
            if key not in failures:
                print(f"failure {len(failures) + 1} after {ApiFuzz.num_examples} examples: {key}",
                      flush=True)
                if args.verbose:
                    traceback.print_exception(exc)
            failures[key] = failures.get(key, 0) + 1
    elapsed = time.perf_counter() - start
    print(f"{ApiFuzz.num_examples} examples ({ApiFuzz.num_calls} calls) in {elapsed:.1f} s "
          f"on backends {BACKENDS}; {len(failures)} distinct failure(s)")
    for key, count in sorted(failures.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d} x {key}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
