"""The ``pagedkv`` command (also ``python -m pagedkv_np``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    parser.add_argument("command", choices=["demo", "bench", "serve"], help="what to run")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the command's own options (see pagedkv COMMAND --help)")
    args = parser.parse_args(argv)
    rest = args.args
    if args.command == "demo":
        from .demo import main as run
    elif args.command == "serve":
        from .serve.command import main as run
    else:
        from .bench import main as run
    return int(run(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
