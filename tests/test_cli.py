"""The ``pagedkv`` command: help texts, version, exit codes, progress lines."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys

import pytest

import pagedkv_np
from pagedkv_np import cli, demo
from pagedkv_np import bench as bench_cli
from pagedkv_np.log import LOGGER_NAME
from pagedkv_np.serve import command as serve_command

# reStructuredText and Markdown that must not reach a terminal
MARKUP = re.compile(r"``|:(class|func|meth|mod|data|attr|exc):|`[^`\s]|\*\*")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedkv_np", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def parsers() -> dict[str, argparse.ArgumentParser]:
    return {"pagedkv": cli.parser(), "demo": demo._parser(), "bench": bench_cli._parser(),
            "serve": serve_command._parser()}


@pytest.mark.parametrize("name", ["pagedkv", "demo", "bench", "serve"])
def test_help_has_no_markup(name):
    text = parsers()[name].format_help()
    assert not MARKUP.search(text), MARKUP.search(text)


@pytest.mark.parametrize("name", ["pagedkv", "demo", "bench", "serve"])
def test_every_option_says_what_it_does_and_its_default(name):
    for action in parsers()[name]._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                               argparse._SubParsersAction)):
            continue
        assert action.help, action.option_strings
        assert "default" in action.help, action.option_strings


def test_subcommands_are_described():
    text = cli.parser().format_help()
    for name, (description, _) in cli.COMMANDS.items():
        assert re.search(rf"^\s+{name}\s+\S", text, flags=re.M), name
        assert description.split()[0] in text
    # the usage line lists what the options list: no hidden positional
    assert "usage: pagedkv [-h] [--version] [-q] COMMAND ..." in text
    assert "args " not in text


def test_bare_command_prints_help_and_succeeds():
    proc = run_cli()
    assert proc.returncode == 0, proc.stderr
    assert "usage: pagedkv" in proc.stdout and "serve" in proc.stdout


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"pagedkv {pagedkv_np.__version__}"


def test_help_imports_nothing_heavy():
    # NumPy, ml_dtypes and Numba take seconds to import on a small machine
    code = ("import sys\n"
            "from pagedkv_np import cli\n"
            "for args in (['--help'], ['demo', '--help'], ['bench', '--help'],\n"
            "             ['serve', '--help']):\n"
            "    try:\n"
            "        cli.main(args)\n"
            "    except SystemExit as exc:\n"
            "        assert exc.code == 0, exc.code\n"
            "heavy = sorted(m for m in ('numpy', 'numba', 'ml_dtypes', 'onnxruntime',\n"
            "                           'starlette', 'uvicorn', 'tokenizers')\n"
            "               if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_usage_errors_exit_2():
    proc = run_cli("nonsense")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    proc = run_cli("demo", "--chats", "0")
    assert proc.returncode == 2 and "--chats: must be at least 1" in proc.stderr
    proc = run_cli("bench", "--op", "nonsense")
    assert proc.returncode == 2 and "unknown operation 'nonsense'" in proc.stderr
    proc = run_cli("--no-such-flag")
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


def test_subcommand_help_is_its_own():
    proc = run_cli("demo", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--chats", "--new-tokens", "--batch", "--pages", "--page-size", "--quiet"):
        assert flag in proc.stdout
    assert "(default: 8)" in proc.stdout


def test_the_lazy_package_exports_what_it_did():
    for name in pagedkv_np.__all__:
        assert getattr(pagedkv_np, name) is not None
    assert "PagedKVCache" in dir(pagedkv_np)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pagedkv_np.nope  # noqa: B018


def test_the_command_leaves_logging_as_it_found_it():
    logger = logging.getLogger(LOGGER_NAME)
    before = (logger.level, list(logger.handlers))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--op", "nonsense"])
    assert (logger.level, logger.handlers) == before
