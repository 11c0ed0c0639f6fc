"""GGUF files (llama.cpp's format) converted into ONNX model folders.

:func:`import_gguf` reads a GGUF file with the ``gguf`` package and writes a
folder that :class:`~pagedkv_np.onnxruntime.OrtDecoder` and
onnxruntime-genai both load::

    model.onnx, model.onnx.data   the decoder (pagedkv_np.models.graph)
    config.json                   Hugging Face style geometry
    generation_config.json        bos / eos
    tokenizer.json                rebuilt from the GGUF vocabulary and merges
    tokenizer_config.json         chat template, bos / eos, add_bos_token, add_eos_token
    genai_config.json             onnxruntime-genai's description of the decoder
    lm_head.npz, step_blocks.npz  blocks the engine runs itself, where the graph
                                  holds them in float32 (see below)

Architectures: ``llama`` (Llama 2/3, SmolLM, TinyLlama, Mistral), ``qwen2``,
``qwen3``, ``phi3`` and ``gemma3`` (what each means:
:mod:`pagedkv_np.models.gguf.reader`); weight types F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (every type of
llama.cpp's Q*_K_M / Q*_K_S files; the IQ types, TQ and MXFP4 are refused by
name from the header). How tensors are read, and how llama.cpp's Q/K row
order is undone: :mod:`pagedkv_np.models.gguf.reader`; how each type runs:
:mod:`pagedkv_np.models.gguf.blocks`. The tokenizer:
:mod:`pagedkv_np.models.gguf.tokenizer`.

Weight modes (``weights=``):

``"q4"``       Types whose codes fit in 4 bits (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K)
               stay in their blocks and run as exact 4-bit ``MatMulNBits``
               (plus a block-sum term for offsets); the 5-8-bit types (Q5_0,
               Q5_1, Q5_K, Q6_K, Q8_0) become float32 (exact: 8-bit
               MatMulNBits was 25-60x slower than a float32 MatMul here)
               unless ``accuracy_level=4``, which runs them as 8-bit blocks;
               at level 0 the layers' 5-8-bit weights are kept in their
               blocks as well, in ``step_blocks.npz``
               (:mod:`pagedkv_np.models.block_file`), for the engine's own
               decode step; F16 tensors stay float16, BF16 become float32.
``"float32"``  every tensor dequantized to float32.
``"float16"``  every matrix stored as float16 (norms stay float32); the
               session casts them to float32 when it loads, so this halves
               the disk size, not the memory.

In ``"q4"`` mode the embedding keeps its blocks too (any block type,
gathered exactly by GatherBlockQuantized), and a tied LM head reads those
same blocks with MatMulNBits: one copy (:mod:`pagedkv_np.models.builder`).
An LM head of a 5-8-bit type (both real files' tied Q8_0 embeddings) runs at
``head_accuracy_level`` (by default the import's ``accuracy_level``): at 0
it leaves the graph, kept in its blocks in ``lm_head.npz``
(:mod:`pagedkv_np.models.head_file`), and the engine multiplies the graph's
``hidden`` output by them with float32 activations, exactly
(:mod:`pagedkv_np.onnxruntime.head`; onnxruntime 1.32's 8-bit MatMulNBits
is fast only on int8 activations, and a float32 head reads four times the
bytes); such a folder has no ``genai_config.json``, since onnxruntime-genai
could not run it. At 4 the head is 8-bit MatMulNBits blocks in the graph,
on int8 activations: faster, but SmolLM2 then answers "What is the capital of
France?" with "L'Étoile, la Marseillaise, ..." instead of "The capital of
France is Paris." (llama.cpp, whose Q8_0 head also takes 8-bit
activations, answers Paris). Figures: the README's GGUF section.

Why ``"q4"`` (with ``accuracy_level=0``) is the default: on
SmolLM2-135M-Instruct's Q4_1 file (``scripts/bench_gguf_modes.py``, batch 1,
this 2-core CPU shared with other jobs) a decoded token cost 12.0 ms of CPU
against float32's 17.2 (one thread; 1.4x; wall-clock medians 21.9 vs 10.4
tokens/s under the load), from 37% of float32's disk space (191 vs 519 MiB)
and 59% of its memory (623 vs 1064 MiB), with the very tokens float32
produces: the file's exact values, computed in float32. ``"float16"``
halves the disk size only (the session holds float32 weights, 17.4 ms per
token). ``accuracy_level=4`` cost 8.2 ms per token (1.5x faster again), but
its int8 activations changed the greedy answer after 30 tokens, so it is an
option, not the default. (Those figures predate ``head_accuracy_level``: an
8-bit head on int8 activations cost Gemma 3 270M 121 CPU ms a token against
181 in float32 (16.0 against 10.2 tokens/s), with greedy tokens leaving the
exact ones after 5-11 tokens on two of three prompts; SmolLM2 67 against 87
(28.7 against 22.3), its 12 tokens of each unchanged: the README's figures.)

Results are cached under ``$PAGEDKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/pagedkv_np``, else ``~/.cache/pagedkv_np``, in a folder
named after the file's content digest (SHA-256), the mode, the family, the
served context and :data:`FORMAT_VERSION`; a second call returns that
folder. The digest is remembered in ``digests/`` there under the file's
identity (path, inode, size, mtime, ctime, sampled bytes:
:mod:`pagedkv_np.digests`), so a file is hashed once, and a different file
put in its place (even of the same size, its mtime restored) is hashed
again. Folders are written beside their final place and renamed into it,
so a failed import leaves nothing behind.

The header comes first: tensor types, the layer count against the tensors
present, the architecture, the geometry and the vocabulary size are checked
from the metadata and tensor table (:mod:`pagedkv_np.models.gguf.header`)
before the vocabulary or any tensor is read, so a file that will be refused
is refused at once, and metadata that lies cannot make the import allocate
for it. The RoPE tables follow the served context (``max_context``), not
the file's ``context_length``.

Command line::

    python -m pagedkv_np.models.gguf.importer FILE.gguf [--weights q4]
        [--family gqa] [--accuracy-level 0] [--max-context 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from ...digests import file_digest
from ...errors import ConfigError
from ...log import long_wait
from ..geometry import DecoderGeometry
from .reader import (ARCHITECTURES, SUPPORTED_TYPES, GGUFFile, GGUFFormatError, kept_blocks,
                     read_geometry, read_weights)
from .blocks import BlockQuantized, NBits, concat_nbits
from .options import (DEFAULT_HEAD_ACCURACY_LEVEL, DEFAULT_MAX_CONTEXT, FAMILIES, FORMAT_VERSION,
                      WEIGHT_MODES, ImportOptions)
from .folder_files import text_files
from ..graph import build_decoder, save_decoder
from ..head_file import HEAD_FILE, save_head
from ..block_file import STEP_FILE, STEP_METADATA_KEY, save_step_blocks
from ...errors import UnsupportedModelError

__all__ = ["GGUFFormatError", "WEIGHT_MODES", "ARCHITECTURES", "FORMAT_VERSION",
           "DEFAULT_MAX_CONTEXT", "DEFAULT_HEAD_ACCURACY_LEVEL",
           "import_gguf", "convert_gguf", "cache_dir_default",
           "file_digest", "main"]

# the graph's packed weights and their parts (pagedkv_np.models.graph)
_PACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
logger = logging.getLogger(__name__)

def cache_dir_default() -> Path:
    """``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv_np``, else
    ``~/.cache/pagedkv_np``."""
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv_np"


_LAYER_NAME = re.compile(r"blk\.(\d+)\.")


def _check_header(f: GGUFFile) -> None:
    """What the header alone shows wrong, checked before the vocabulary,
    geometry or any tensor is read: a tensor type this importer does not
    read (named, with its type), and a layer count that the tensors do not
    have (``block_count = 10**7`` once built 90 million names, 2.2 GiB)."""
    for name, t in f.tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{f.path!r}: tensor {name!r} has type {t.type_name}; supported: "
                f"{', '.join(q.name for q in SUPPORTED_TYPES)}")
    arch = f.get("general.architecture", kind=str)
    count = None if arch is None else f.get(f"{arch}.block_count")
    if count is not None:
        found = {int(m.group(1)) for name in f.tensors if (m := _LAYER_NAME.match(name))}
        present = max(found) + 1 if found else 0
        if count != present:
            raise GGUFFormatError(f"{f.path!r}: metadata {arch}.block_count is {count:,} but "
                                  f"the file has tensors for {present} layers")


def _served(f: GGUFFile, c: DecoderGeometry, opts: ImportOptions) -> DecoderGeometry:
    """The geometry with the positions that will be served: ``max_context``,
    or the file's ``context_length`` when smaller. RoPE tables have as many
    rows (a file's 2**31 - 1 once asked for 16 GiB of them)."""
    num_tokens = f.meta.length("tokenizer.ggml.tokens")
    if num_tokens is not None and num_tokens > c.vocab_size:
        raise GGUFFormatError(f"{f.path!r}: {num_tokens} tokens but an embedding of "
                              f"{c.vocab_size} rows")
    return dataclasses.replace(c, max_positions=min(c.max_positions, opts.max_context))


@dataclasses.dataclass(frozen=True)
class _Header:
    """A file whose header passed every check, and what the checks read."""

    file: GGUFFile
    arch: str
    geometry: DecoderGeometry        # with the served context
    file_context: int


def _check(path: str, opts: ImportOptions) -> _Header:
    """Everything the header shows (types, layers, architecture, geometry,
    vocabulary size), checked before the vocabulary or a tensor is read, and
    before the file is hashed: a file that will be refused is refused at once."""
    f = GGUFFile(path)
    _check_header(f)
    arch, c = read_geometry(f)
    served = _served(f, c, opts)
    if opts.family == "gqa" and c.head_dim % 16:
        raise UnsupportedModelError(f"{path!r}: head size {c.head_dim} is not a multiple of "
                                    "16, which GroupQueryAttention needs; use family='optimum'")
    return _Header(f, arch, served, c.max_positions)


def _build(header: _Header, folder: Path, opts: ImportOptions, provenance: dict) -> None:
    """Write the model folder's files into ``folder`` (an empty directory)."""
    f, arch, c, file_context = header.file, header.arch, header.geometry, header.file_context
    text = text_files(f, arch, c, opts.family, c.tie_word_embeddings)
    engine_head = _engine_head(f, opts)
    graph_geometry, tensors = read_weights(
        f, arch, c, opts.weights, kept_blocks(opts.weights, 4),
        kept_blocks(opts.weights, 4 if engine_head else opts.head_level))
    del f, header
    step = _step_blocks(tensors, kept_blocks(opts.weights, opts.accuracy_level))
    if step:
        save_step_blocks(folder / STEP_FILE, step)
    del step
    head = tensors.get("lm_head", tensors["embed"])      # 8-bit heads run at their own level
    eight_bit = isinstance(head, BlockQuantized) and head.spec.bits == 8
    if engine_head:
        assert isinstance(head, BlockQuantized)
        save_head(folder / HEAD_FILE, head.matmul_nbits(), c.final_softcap)
    del head
    # weights stream into model.onnx.data as the graph takes them: held once, not thrice
    model = build_decoder(graph_geometry, tensors, family=opts.family,
                          accuracy_level=opts.accuracy_level,
                          head_accuracy_level=(opts.head_level if eight_bit
                                               else opts.accuracy_level),
                          name=f"{arch}_{opts.weights}",
                          external_data=folder / "model.onnx.data",
                          head_file=HEAD_FILE if engine_head else None)
    del tensors
    if (folder / STEP_FILE).is_file():
        prop = model.metadata_props.add()
        prop.key, prop.value = STEP_METADATA_KEY, STEP_FILE
    save_decoder(model, folder)
    del model
    (folder / "tokenizer.json").write_text(text["tokenizer.json"], encoding="utf-8")
    text["config.json"]["pagedkv_np"] = dict(provenance, max_context=c.max_positions,
                                             file_context_length=file_context)
    if engine_head:     # onnxruntime-genai could not run a graph without its head
        del text["genai_config.json"]
    for name, value in text.items():
        if name != "tokenizer.json":
            (folder / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _step_blocks(tensors: dict, graph_kinds: dict) -> dict[str, NBits]:
    """Take the layer weights in blocks of kinds that the graph does not run
    (the 5-8-bit ones at ``accuracy_level=0``) out of ``tensors``: float32
    ``[in, out]`` there, for the graph's prompt products, and their parts in
    the result, for the step file (:mod:`pagedkv_np.models.block_file`);
    Q/K/V and gate/up packed where their parts fit together, as the graph
    packs them."""
    kinds = set(graph_kinds.values())
    step = {}
    for key, t in list(tensors.items()):
        if key not in ("embed", "lm_head") and isinstance(t, BlockQuantized) \
                and t.kind not in kinds:
            step[key] = t.matmul_nbits()
            tensors[key] = np.ascontiguousarray(t.dequantize_rows().T)
    for packed, names in _PACKED.items():
        for layer in {key.split(".", 1)[0] for key in step}:
            keys = [f"{layer}.{name}" for name in names]
            if all(key in step for key in keys):
                joined = concat_nbits([step[key] for key in keys])
                if joined is not None:
                    for key in keys:
                        del step[key]
                    step[f"{layer}.{packed}"] = joined
    return step


def _engine_head(f: GGUFFile, opts: ImportOptions) -> bool:
    """Whether the LM head stays in its blocks beside the graph, for the engine
    to run exactly (:mod:`pagedkv_np.models.head_file`): a head of a 5-8-bit
    block type in ``"q4"`` mode at head level 0, which the graph would
    otherwise hold as float32."""
    if opts.weights != "q4" or opts.head_level == 4:
        return False
    t = f.tensors.get("output.weight") or f.tensors.get("token_embd.weight")
    return (t is not None and t.tensor_type in kept_blocks("q4", 4)
            and t.tensor_type not in kept_blocks("q4", 0))


def _write_atomically(path: str, header: _Header, target: Path, opts: ImportOptions,
                      provenance: dict) -> Path:
    """Build into a fresh directory beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)     # mkdtemp's 0700 would hide a shared cache from other users
        size_mb = os.path.getsize(path) / 1e6
        # measured: SmolLM2-135M's 98 MB Q4_1 file in 18 s on 2 busy cores
        with long_wait(logger, f"importing {os.path.basename(path)} ({size_mb:.0f} MB) "
                               f"into {target}", f"about {max(1, round(size_mb / 5))} s on "
                               "2 cores, once: the folder is kept"):
            _build(header, tmp, opts, provenance)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.onnx").is_file():
                raise
            shutil.rmtree(tmp)        # another process finished the same folder first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, weights: str = "q4",
                 family: str = "gqa", accuracy_level: int = 0,
                 max_context: int = DEFAULT_MAX_CONTEXT,
                 head_accuracy_level: int | None = DEFAULT_HEAD_ACCURACY_LEVEL) -> Path:
    """Write the model folder for ``path`` at ``out_dir`` (which must not exist
    or be empty), without the cache. Same options and errors as :func:`import_gguf`."""
    opts = ImportOptions(weights, family, accuracy_level, max_context, head_accuracy_level)
    target = Path(out_dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"Invalid out_dir: {str(target)!r} exists and is not an empty folder")
    source = os.fspath(path)
    if not os.path.isfile(source):
        raise ConfigError(f"Invalid path: no file {source!r}")
    header = _check(source, opts)
    if target.is_dir():
        target.rmdir()
    return _write_atomically(source, header, target, opts, opts.provenance(source))


def import_gguf(path: str | os.PathLike, *, weights: str = "q4", family: str = "gqa",
                cache_dir: str | os.PathLike | None = None, accuracy_level: int = 0,
                max_context: int = DEFAULT_MAX_CONTEXT,
                head_accuracy_level: int | None = DEFAULT_HEAD_ACCURACY_LEVEL) -> Path:
    """The model folder of a GGUF file, built once and cached.

    Parameters
    ----------
    path : str or path
        A ``.gguf`` file.
    weights : {"q4", "float32", "float16"}
        How weights are stored (see the module docstring).
    family : {"gqa", "optimum"}
        The graph's I/O family (:mod:`pagedkv_np.onnxruntime.model_io`).
    cache_dir : str or path, optional
        Where model folders are kept (default :func:`cache_dir_default`).
    accuracy_level : {0, 4}
        MatMulNBits' ``accuracy_level`` in ``"q4"`` mode: 0 computes with the
        file's exact weights in float32; 4 quantizes activations to int8, as
        llama.cpp does for its 4-bit products (faster, not exact), and then
        also runs the 5-8-bit types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) as 8-bit
        blocks.
    max_context : int
        Positions the model folder serves (its RoPE tables' rows,
        ``config.json``'s ``max_position_embeddings``): this, or the file's
        ``context_length`` when smaller. ``config.json`` keeps both under
        ``"pagedkv_np"``.
    head_accuracy_level : {0, 4}, optional
        In ``"q4"`` mode, the level of an LM head of a 5-8-bit type (Q8_0,
        Q6_K, ...: both real files' tied embeddings; None, the default:
        ``accuracy_level``): at 0 kept in its blocks beside the graph and run
        by the engine, exact; at 4 as 8-bit blocks in the graph with
        int8 activations (faster, inexact: see the module docstring). A 4-bit
        head runs at ``accuracy_level``.

    Returns
    -------
    pathlib.Path
        The folder (``model.onnx`` + ``model.onnx.data``, ``config.json``,
        ``generation_config.json``, ``tokenizer.json``,
        ``tokenizer_config.json``, ``genai_config.json``).

    Raises
    ------
    ConfigError
        An unknown mode, family or accuracy level, a bad ``max_context``, or
        no such file.
    UnsupportedModelError
        An architecture, tensor type (the message names the tensor), tokenizer
        or feature this importer does not convert.
    GGUFFormatError
        A truncated or corrupt file, or metadata that its tensors contradict
        (a subclass of UnsupportedModelError; the message names the key).
    """
    opts = ImportOptions(weights, family, accuracy_level, max_context, head_accuracy_level)
    source = os.fspath(path)
    if not os.path.isfile(source):
        raise ConfigError(f"Invalid path: no file {source!r}")
    root = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    header = _check(source, opts)
    digest = file_digest(source, root, save=False)
    target = root / f"{digest[:32]}-{opts.tag}-v{FORMAT_VERSION}"
    if not ((target / "model.onnx").is_file() and (target / "config.json").is_file()):
        _write_atomically(source, header, target, opts,
                          dict(opts.provenance(source), sha256=digest))
    del header
    file_digest(source, root)     # remembered for the next process, once the folder is there
    return target


def main(argv: list[str] | None = None) -> int:
    """Convert a GGUF file (see the module docstring); prints the folder."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv_np.models.gguf.importer",
                                     description="Convert a GGUF file into an ONNX model folder.")
    parser.add_argument("path", help="the .gguf file")
    parser.add_argument("--weights", choices=WEIGHT_MODES, default="q4")
    parser.add_argument("--family", choices=FAMILIES, default="gqa")
    parser.add_argument("--accuracy-level", type=int, choices=(0, 4), default=0,
                        help="q4 mode: 4 computes with int8 activations (faster, inexact)")
    parser.add_argument("--head-accuracy-level", type=int, choices=(0, 4),
                        default=DEFAULT_HEAD_ACCURACY_LEVEL,
                        help="q4 mode: the LM head's (default: --accuracy-level's; 0: an "
                             "8-bit head in blocks run by the engine, exact; 4: int8 "
                             "activations, faster, "
                             "inexact)")
    parser.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                        help="positions to serve (default %(default)s, or the file's "
                             "context_length when smaller)")
    parser.add_argument("--out", default=None,
                        help="write the folder here instead of the cache")
    args = parser.parse_args(argv)
    options = dict(weights=args.weights, family=args.family,
                   accuracy_level=args.accuracy_level, max_context=args.max_context,
                   head_accuracy_level=args.head_accuracy_level)
    try:
        if args.out is not None:
            folder = convert_gguf(args.path, args.out, **options)
        else:
            folder = import_gguf(args.path, **options)
    except (ConfigError, UnsupportedModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
