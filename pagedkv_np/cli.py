"""The ``pagedkv`` command (also ``python -m pagedkv_np``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    parser.add_argument("command", choices=["demo", "bench"], help="what to run")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as run
    else:
        from .bench import main as run
    return int(run(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
