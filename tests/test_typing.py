"""The package type-checks cleanly and ships its PEP 561 marker.

mypy reads its settings from ``[tool.mypy]`` in pyproject.toml, so it runs
from the repository root, exactly as a developer runs it by hand.
"""

import subprocess
import sys
from pathlib import Path

import pagedkv_np

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_errors():
    proc = subprocess.run([sys.executable, "-m", "mypy", "pagedkv_np"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout}{proc.stderr}"


def test_py_typed_marker_is_in_the_package():
    # without it, type checkers ignore the package's annotations in an install
    assert (Path(pagedkv_np.__file__).parent / "py.typed").is_file()
