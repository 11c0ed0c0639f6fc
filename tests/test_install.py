"""The install lines of the README and the docs work.

A fresh virtual environment gets the package built from this checkout (the
README's ``pip install .``), then runs ``pagedkv --version`` and the README's
first example from outside the checkout. The package itself is installed
with ``--no-deps``; its dependencies come from the test's own environment
through a ``.pth`` file placed after the fresh environment's own
site-packages, since installing NumPy, Numba and onnxruntime anew took
81 s (core) and 278 s (``[models,serve]``) on a busy 2-core machine, against
20 s for the build and install of the package alone.
"""

from __future__ import annotations

import os
import re
import shlex
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the names of [project.optional-dependencies] (tomllib is Python 3.11+)
# the fresh environment sees only what is installed in it (and its .pth)
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
EXTRAS = set(re.findall(r"^([a-z]+) = \[", (ROOT / "pyproject.toml").read_text().split(
    "[project.optional-dependencies]")[1].split("\n[")[0], flags=re.M))


def install_lines() -> list[tuple[str, str]]:
    """Every ``pip install`` command in the docs that installs something, with
    the file it is in (prose that names the command alone, ``pip install -e``,
    is not one)."""
    found = []
    for path in DOCS:
        for match in re.finditer(r"pip install [^\n`#)]*", path.read_text()):
            line = match.group(0).strip()
            if any(not w.startswith("-") for w in line.split()[2:]):
                found.append((path.name, line))
    return found


def test_the_docs_have_install_lines():
    names = {name for name, _ in install_lines()}
    assert "README.md" in names and "index.md" in names


@pytest.mark.parametrize("where,line", install_lines())
def test_every_install_line_names_something_that_exists(where, line):
    words = shlex.split(line.replace("$REPO_URL", "REPO_URL"))[2:]
    targets = [w for w in words if not w.startswith("-")]
    assert targets, f"{where}: {line}"
    for target in targets:
        m = re.fullmatch(r"(\.|pagedkv-np)\[([a-z,]+)\](?: @ git\+REPO_URL)?", target)
        if m is not None:        # this project, from a checkout or its git URL
            assert set(m.group(2).split(",")) <= EXTRAS, f"{where}: {line}"
        else:                    # something from PyPI, pinned or not; never this project
            assert not target.startswith("pagedkv-np"), f"{where}: {line} (not on PyPI)"
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?([=<>!~]=?[\w.,<>=]+)?",
                                target), f"{where}: {line}"


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    # no pip of its own (installing one takes half a minute): this one installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "-q", "--no-deps", str(ROOT)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    # the dependencies: this environment's site-packages, after the fresh one's own
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True, timeout=60, env=CLEAN_ENV).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "zz_test_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return venv


def test_installed_command_and_readme_example(fresh_venv, tmp_path):
    bin_dir = fresh_venv / "bin"
    proc = subprocess.run([str(bin_dir / "pagedkv"), "--version"], capture_output=True,
                          text=True, timeout=120, check=False, cwd=tmp_path, env=CLEAN_ENV)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"pagedkv \d+\.\d+\.\d+\n", proc.stdout)

    readme = (ROOT / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]
    check = ("import pagedkv_np, sys\n"
             f"assert pagedkv_np.__file__.startswith({str(fresh_venv)!r}), pagedkv_np.__file__\n"
             f"assert {str(ROOT)!r} not in sys.path, sys.path\n")   # not the checkout
    script = tmp_path / "example.py"
    script.write_text(check + example)
    proc = subprocess.run([str(bin_dir / "python"), str(script)], capture_output=True,
                          text=True, timeout=600, check=False, cwd=tmp_path, env=CLEAN_ENV)
    assert proc.returncode == 0, proc.stderr
    assert "from the cache" in proc.stdout


def test_installed_package_carries_its_kernels(fresh_venv):
    # the CUDA sources travel in the wheel as package data
    code = ("import importlib.resources as r\n"
            "print(sorted(p.name for p in r.files('pagedkv_np').joinpath('_kernels')"
            ".iterdir() if p.name.endswith('.cu')))\n")
    proc = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", code], capture_output=True,
                          text=True, timeout=120, check=False, cwd=fresh_venv, env=CLEAN_ENV)
    assert proc.returncode == 0, proc.stderr
    shipped = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert shipped and proc.stdout.strip() == str(shipped)


def test_the_git_url_line_resolves_to_this_project(tmp_path):
    # the README's "pip install 'pagedkv-np[...] @ git+$REPO_URL'", with this
    # checkout's committed HEAD as the repository
    line = next(line for _, line in install_lines() if "git+$REPO_URL" in line)
    spec = shlex.split(line.replace("$REPO_URL", f"file://{ROOT}"))[2]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                           "--ignore-installed", "--report", str(tmp_path / "report.json"),
                           "-q", spec], capture_output=True, text=True, timeout=300,
                          check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "report.json").read_text()
    assert '"name": "pagedkv-np"' in report and '"requested_extras": [' in report
