"""The documentation site builds without a warning, and says what the code does.

``mkdocs build --strict`` fails on any warning: a page left out of the nav, a
broken link or anchor, a docstring mkdocstrings cannot read. The server
reference lists every option of ``pagedkv serve`` with its default and every
route of the app; the docs' Python examples run as written.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv_np.serve import command as serve_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# the guide's pages, whose examples stand alone (security.md's are fragments)
GUIDE = ("index.md", "concepts.md", "server.md", "models.md")
BLOCKS = [(page.name, i, block) for page in PAGES if page.name in GUIDE
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(),
                                               flags=re.S))]


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr
    site = tmp_path / "site"
    assert (site / "index.html").is_file()
    for page in ("concepts", "server", "models", "benchmarks", "security", "api/cache"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "api" / "engine" / "index.html").read_text()
    # numpydoc sections rendered, and no reStructuredText left in the text
    assert "OrtDecoder" in api and "Parameters:" in api
    assert "``" not in api and ":class:" not in api


def serve_options() -> list[argparse.Action]:
    return [a for a in serve_command._parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("action", serve_options(), ids=lambda a: a.option_strings[-1])
def test_server_reference_lists_every_option_with_its_default(action):
    text = (DOCS / "server.md").read_text()
    flag = max(action.option_strings, key=len)
    row = re.search(rf"^\| `{re.escape(flag)}( [A-Z]+)?` \| ([^|]*) \|", text, flags=re.M)
    assert row is not None, f"{flag} is not in docs/server.md's option table"
    default = action.default
    if isinstance(default, (int, float, str)) and not isinstance(default, bool):
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert shown in row.group(2), f"{flag}: default {shown} not in {row.group(2)!r}"


def test_server_reference_lists_every_route():
    text = (DOCS / "server.md").read_text()
    source = (ROOT / "pagedkv_np" / "serve" / "app.py").read_text()
    routes = re.findall(r'Route\("([^"]+)", \w+\.\w+, methods=\["(\w+)"\]\)', source)
    assert len(routes) >= 5
    for path, method in routes:
        assert f"`{method} {path}`" in text, (method, path)


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_docs_python_examples_run(page, index, block, capsys):
    exec(compile(block, f"docs/{page}[python block {index}]", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_every_command_in_the_docs_exists():
    from pagedkv_np.cli import COMMANDS

    for page in [*PAGES, ROOT / "README.md"]:
        for name in re.findall(r"^\s*pagedkv (?:--\w+ )*([a-z]+)\b", page.read_text(),
                               flags=re.M):
            assert name in COMMANDS, f"{page.name}: pagedkv {name}"
