"""Long waits say what they do: the ``pagedkv_np`` logger's INFO lines."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from pagedkv_np.log import LOGGER_NAME, long_wait, show_progress


@pytest.fixture
def restore_logger():
    logger = logging.getLogger(LOGGER_NAME)
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_progress_lines_go_to_stderr_and_quiet_hides_them(capsys, restore_logger):
    log = logging.getLogger(LOGGER_NAME + ".test")
    show_progress()
    with long_wait(log, "importing a model", "about 2 s, once"):
        pass
    err = capsys.readouterr().err
    assert "pagedkv: importing a model (about 2 s, once) ..." in err
    assert re.search(r"pagedkv: importing a model: done in \d+\.\d s", err)
    show_progress(quiet=True)
    with long_wait(log, "importing a model", "about 2 s, once"):
        pass
    assert capsys.readouterr().err == ""
    mine = [h for h in logging.getLogger(LOGGER_NAME).handlers if h.get_name() == "pagedkv-cli"]
    assert len(mine) == 1    # the second call replaced the first one's handler


def test_a_library_call_is_silent_unless_asked(restore_logger):
    # Python shows no INFO line of a library unless the application configures logging
    code = ("from pagedkv_np.log import long_wait\n"
            "import logging\n"
            "with long_wait(logging.getLogger('pagedkv_np.x'), 'waiting', 'a moment'):\n"
            "    pass\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


USE_NUMBA = """
import logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
from pagedkv_np import PagedKVCache
cache = PagedKVCache(1, 4, 2, 1, 8, dtype="float32", layout="NHD", backend="numba")
seq = cache.add_sequence([1, 2, 3])
cache.extend(seq, [1, 2, 3])
plan = cache.plan([seq])
cache.write(0, plan, np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))
print("gathered", cache.gather(0, plan, layout="BTHD")[0].sum())
"""


def run_python(code: str, numba_dir) -> str:
    env = {"PAGEDKV_NUMBA_CACHE_DIR": str(numba_dir), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_compile_says_so_once_and_a_cached_kernel_says_nothing(tmp_path):
    out = run_python(USE_NUMBA, tmp_path)
    assert "gathered 24.0" in out
    lines = [x for x in out.splitlines() if "compiling the Numba kernels" in x]
    assert len(lines) == 1, out    # once per process, not once per kernel
    assert lines[0].startswith("pagedkv_np.backends.jit: compiling the Numba kernels on "
                               "their first use: about 20 s")
    assert f"then cached in {tmp_path}" in lines[0]
    out = run_python(USE_NUMBA, tmp_path)    # a new process finds them on disk
    assert "gathered 24.0" in out and "compiling" not in out


def test_warmup_says_what_it_does():
    # the user's kernel cache, as the rest of the test-suite fills it
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout,\n"
            "                    format='%(name)s: %(message)s')\n"
            "from pagedkv_np import warmup\n"
            "from pagedkv_np.backends.jit import cache_dir\n"
            "warmup(['float32'], ['NHD'], ['BTHD'])\n"
            "print('cache', cache_dir())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    where = proc.stdout.splitlines()[-1].removeprefix("cache ")
    assert "pagedkv_np.backends.warmup: compiling the Numba kernels (about 40 s on 2 idle " \
           "cores when nothing is cached, minutes on a busy machine; under a second once " \
           f"they are cached in {where}) ..." in proc.stdout
    assert re.search(r"warmup: compiling the Numba kernels: done in \d+\.\d s", proc.stdout)


def test_a_gguf_import_says_what_it_does_once(tmp_path, caplog):
    from pagedkv_np.models.gguf.importer import import_gguf
    from test_gguf_import import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        folder = import_gguf(path, cache_dir=tmp_path / "models")
    lines = [r.getMessage() for r in caplog.records
             if r.name == "pagedkv_np.models.gguf.importer"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("importing tiny.gguf (0 MB) into ")
    assert lines[0].endswith("(about 1 s on 2 cores, once: the folder is kept) ...")
    assert re.fullmatch(r"importing tiny\.gguf \(0 MB\) into .*: done in \d+\.\d s", lines[1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert import_gguf(path, cache_dir=tmp_path / "models") == folder
    assert not [r for r in caplog.records if "importing" in r.getMessage()]   # cached: silent
