"""A small Llama-architecture ONNX decoder with seeded random weights.

RMSNorm, rotary position embedding (rotate-half), grouped-query attention
with fewer K/V heads than query heads and a SwiGLU MLP, built with
``onnx.helper`` from NumPy weights: no torch, no download. The same weights
come in the two I/O families that :class:`~pagedkv_np.onnxruntime.OrtDecoder`
reads:

``"optimum"``
    What optimum / ``torch.onnx`` exports look like: attention from
    MatMul/Softmax, ``past_key_values.{i}.key|value`` concatenated with the
    new tokens' K/V into ``present.{i}.key|value``; inputs ``input_ids``,
    ``attention_mask`` and (unless ``position_ids=False``, in which case
    positions come from the mask's running sum) ``position_ids``.
``"gqa"``
    What the onnxruntime-genai model builder writes: one
    ``com.microsoft.GroupQueryAttention`` node per layer, rotary inside the
    op, no ``position_ids``; ``seqlens_k`` and ``total_sequence_length`` come
    from ``attention_mask``; past inputs and present outputs are listed all
    keys, then all values.

:func:`reference_logits` runs the same network in NumPy (no cache), so the
ONNX graphs themselves can be checked. The graph and the NumPy forward pass
are those of :mod:`pagedkv_np.models.graph`, which real-weight models
are built with too. The LM head is scaled so that logits
spread over tens of units: greedy argmax then does not hinge on rounding
differences between batched and unbatched runs. Attention is sharpened (a
larger query scale) so that the next token depends on the whole context, not
only on the last token; ``tests/test_testmodel.py`` checks both properties.

Command line (writes a model for benchmarks)::

    python -m pagedkv_np.models.testmodel model.onnx --family gqa \\
        --hidden 512 --layers 4 --heads 8 --kv-heads 2 --vocab 1024
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

try:
    import onnx
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv_np.models.testmodel needs onnx: pip install 'pagedkv-np[onnx]'"
    ) from exc

from ..errors import ConfigError
from .geometry import DecoderGeometry
from .graph import FAMILIES, build_decoder
from .graph import reference_logits as graph_reference_logits

__all__ = ["DecoderConfig", "FAMILIES", "LOGIT_SCALE", "QUERY_SCALE", "make_weights",
           "build_model", "save_model", "reference_logits", "main"]

#: The test decoder's sizes: :class:`~pagedkv_np.models.geometry.DecoderGeometry`
#: itself, whose defaults are this decoder's (vocabulary 256, hidden 64, 2 layers,
#: 4 heads, 2 K/V heads, head_dim 16, intermediate 192).
DecoderConfig = DecoderGeometry

#: the LM head's scale: logits spread over tens of units
LOGIT_SCALE = 30.0
#: the query projection's scale: sharper attention than random weights give
QUERY_SCALE = 2.0


def make_weights(config: DecoderGeometry, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float32 weights (``x @ w`` convention: ``w`` is [in, out])."""
    rng = np.random.default_rng(seed)
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    nq, nkv = config.num_heads * d, config.num_kv_heads * d

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w: dict[str, np.ndarray] = {"embed": normal((config.vocab_size, h), 1.0)}
    for i in range(config.num_layers):
        w[f"l{i}.attn_norm"] = (1.0 + normal((h,), 0.1)).astype(np.float32)
        w[f"l{i}.wq"] = normal((h, nq), QUERY_SCALE / np.sqrt(h))
        w[f"l{i}.wk"] = normal((h, nkv), 1.0 / np.sqrt(h))
        w[f"l{i}.wv"] = normal((h, nkv), 1.0 / np.sqrt(h))
        w[f"l{i}.wo"] = normal((nq, h), 1.0 / np.sqrt(nq))
        w[f"l{i}.mlp_norm"] = (1.0 + normal((h,), 0.1)).astype(np.float32)
        w[f"l{i}.w_gate"] = normal((h, f), 1.0 / np.sqrt(h))
        w[f"l{i}.w_up"] = normal((h, f), 1.0 / np.sqrt(h))
        w[f"l{i}.w_down"] = normal((f, h), 1.0 / np.sqrt(f))
    w["final_norm"] = (1.0 + normal((h,), 0.1)).astype(np.float32)
    w["lm_head"] = normal((h, config.vocab_size), LOGIT_SCALE / np.sqrt(h))
    # the architecture options' weights come from a stream of their own, so that
    # the Llama-style decoder's weights stay what they always were
    rng = np.random.default_rng([seed, 1])
    for i in range(config.num_layers):
        if config.qkv_bias:
            w.update({f"l{i}.bq": normal((nq,), 0.1), f"l{i}.bk": normal((nkv,), 0.1),
                      f"l{i}.bv": normal((nkv,), 0.1)})
        names = ((["q_norm", "k_norm"] if config.qk_norm else [])
                 + (["post_attn_norm", "post_mlp_norm"] if config.post_norms else []))
        for name in names:
            size = d if name in ("q_norm", "k_norm") else h
            w[f"l{i}.{name}"] = (1.0 + normal((size,), 0.1)).astype(np.float32)
    return w


def reference_logits(config: DecoderGeometry, token_ids: Any,
                     weights: dict[str, np.ndarray] | None = None, seed: int = 0) -> np.ndarray:
    """Logits of every position of one sequence, computed in NumPy without a cache.

    Parameters
    ----------
    token_ids : sequence of int, length S >= 1
    weights : dict, optional
        From :func:`make_weights` (made from ``config`` and ``seed`` when omitted).

    Returns
    -------
    ndarray, shape [S, vocab_size], dtype float32
    """
    w = make_weights(config, seed) if weights is None else weights
    return graph_reference_logits(config, dict(w), token_ids)


def build_model(config: DecoderGeometry | None = None, *, family: str = "optimum",
                position_ids: bool = True, seed: int = 0) -> onnx.ModelProto:
    """Build the test decoder as an ONNX model.

    Parameters
    ----------
    config : DecoderConfig, optional
        Sizes (default ``DecoderConfig()``).
    family : {"optimum", "gqa"}
        I/O family (see the module docstring).
    position_ids : bool
        Whether an ``"optimum"`` model takes ``position_ids`` (ignored for
        ``"gqa"``, which never does).
    seed : int
        Of the random weights (:func:`make_weights`).

    Returns
    -------
    onnx.ModelProto
        Inputs ``input_ids`` int64 [B, S], ``attention_mask`` int64 [B, P + S],
        (``position_ids`` int64 [B, S]), past K/V float32
        [B, num_kv_heads, P, head_dim]; outputs ``logits`` float32 [B, S, vocab]
        and present K/V float32 [B, num_kv_heads, P + S, head_dim].
    """
    config = config or DecoderGeometry()
    if family not in FAMILIES:
        raise ConfigError(f"Invalid family: expected one of {FAMILIES}, got {family!r}")
    return build_decoder(config, dict(make_weights(config, seed)), family=family,
                         position_ids=position_ids, name=f"pagedkv_test_decoder_{family}")


def save_model(model: onnx.ModelProto, path: str) -> None:
    """Write ``model`` to ``path`` (weights over 1 GiB go to ``path + '.data'``)."""
    large = model.ByteSize() > (1 << 30)
    onnx.save_model(model, path, save_as_external_data=large, all_tensors_to_one_file=True,
                    location=path.rsplit("/", 1)[-1] + ".data" if large else None)


def main(argv: list[str] | None = None) -> int:
    """Write a test decoder to a file (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_np.models.testmodel",
        description="Write a seeded random Llama-style ONNX decoder.")
    parser.add_argument("path", help="output .onnx file")
    parser.add_argument("--family", choices=FAMILIES, default="optimum")
    parser.add_argument("--no-position-ids", action="store_true",
                        help="optimum family: take positions from attention_mask")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=0, help="0: 3 x hidden")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = DecoderGeometry(vocab_size=args.vocab, hidden_size=args.hidden,
                             num_layers=args.layers, num_heads=args.heads,
                             num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                             max_positions=args.max_positions)
    model = build_model(config, family=args.family, position_ids=not args.no_position_ids,
                        seed=args.seed)
    save_model(model, args.path)
    print(f"wrote {args.path}: {args.family} family, seed {args.seed}, {config}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
