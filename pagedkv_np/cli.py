"""The ``pagedkv`` command (also ``python -m pagedkv_np``).

Each subcommand keeps its own options in its own module; this one picks the
subcommand, shows the package's progress lines (the ``pagedkv_np`` logger,
:mod:`pagedkv_np.log`) on stderr unless ``--quiet``, and turns the result
into an exit status. Nothing heavy is imported before a subcommand runs, so
``pagedkv --help`` and ``pagedkv --version`` answer at once.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["COMMANDS", "EXIT_STATUS", "main", "parser"]

# name -> (one-line description, module whose main(argv) runs it)
COMMANDS = {
    "demo": ("serve eight chats with a real model (SmolLM2-135M), prefix reuse on and off, "
             "and compare them", "pagedkv_np.demo"),
    "bench": ("time the cache's operations per backend and dtype, beside a plain copy of "
              "the same bytes", "pagedkv_np.bench"),
    "serve": ("serve a model over an OpenAI-compatible HTTP API", "pagedkv_np.serve.command"),
}

EXIT_STATUS = """\
exit status:
  0    success (a bare 'pagedkv' prints this help and exits 0)
  1    the command ran and failed: 'demo' got different answers with reuse
       on and off
  2    a usage error, or 'serve' could not load the model
  130  interrupted (Ctrl-C)
"""


def parser() -> argparse.ArgumentParser:
    """The top-level parser: global options and the subcommands' names."""
    from . import __version__

    p = argparse.ArgumentParser(
        prog="pagedkv",
        description="A paged K/V cache with prefix reuse for LLM generation on CPU:\n"
                    "a demo, a benchmark and an OpenAI-compatible server.",
        epilog="Run 'pagedkv COMMAND --help' for a command's options.\n\n" + EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pagedkv {__version__}",
                   help="print the version and exit")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines on stderr (what a long wait is doing: compiling "
                        "kernels, importing a model; default: shown)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                           help="what to run (default: print this help)")
    for name, (description, _) in COMMANDS.items():
        # the subcommand's own parser handles its options and its --help
        sub.add_parser(name, help=description, description=description, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``pagedkv``; returns the exit status (see :data:`EXIT_STATUS`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args, rest = p.parse_known_args(argv)
    if args.command is None:
        if rest:
            p.error(f"unrecognized arguments: {' '.join(rest)}")
        p.print_help()
        return 0
    import logging
    from importlib import import_module

    from .log import LOGGER_NAME, show_progress

    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    handler = show_progress(quiet=args.quiet)
    if args.command == "demo" and args.quiet:
        rest = ["--quiet", *rest]
    run = import_module(COMMANDS[args.command][1]).main
    try:
        return int(run(rest) or 0)
    except KeyboardInterrupt:
        print("pagedkv: interrupted", file=sys.stderr)
        return 130
    finally:   # as it was: main() may run again in the same process (tests)
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
