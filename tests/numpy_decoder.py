"""An independent NumPy forward pass of a GGUF decoder, for tests.

Written from the file's own conventions, apart from the package's reader and
graph builder: the header is walked here (:func:`read_gguf`, after ggml's
``gguf.md``; ``gguf.GGUFReader`` took 97 s on Gemma 3's 262,144-token
vocabulary on a busy 2-core machine, this walk well under a second, and
``tests/test_gguf_arch.py`` checks the two agree), tensors are decoded with
``gguf.quants.dequantize`` and used as GGUF stores them (``[out, in]`` rows,
``y = x @ W.T``); a ``llama`` file's permuted Q/K rows are rotated pairwise
(interleaved RoPE, as llama.cpp computes it) instead of being put back in
order; RoPE is a complex multiplication; fused tensors are split where they
are used; attention loops over heads. Covers llama, qwen2, qwen3, phi3 and
gemma3 as llama.cpp's ``src/models/*.cpp`` describe them.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np

__all__ = ["GGUFDecoder", "read_gguf"]

# GGUF value types: struct format of the scalars, 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}


def read_gguf(path: str, max_array: int = 4096) -> tuple[dict, dict]:
    """(metadata, tensors) of a GGUF file, without ``gguf.GGUFReader``.

    Metadata arrays longer than ``max_array`` (a vocabulary) are skipped.
    Tensors map name -> (ggml type, array as ``GGUFReader`` gives it: float
    types shaped [..., row], block types uint8 [..., bytes per row]).
    """
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    raw = memoryview(buf)
    at = 0

    def take(fmt):
        nonlocal at
        value = struct.unpack_from(fmt, raw, at)
        at += struct.calcsize(fmt)
        return value[0]

    def string():
        nonlocal at
        n = take("<Q")
        at += n
        return bytes(raw[at - n:at]).decode("utf-8")

    def value(kind):
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == 8:
            return string()
        elem, count = take("<I"), take("<Q")
        items = [value(elem) for _ in range(count)]
        return items if count <= max_array else None

    if bytes(raw[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    at = 4
    take("<I")
    num_tensors, num_kv = take("<Q"), take("<Q")
    meta = {}
    for _ in range(num_kv):
        key = string()
        item = value(take("<I"))
        if item is not None:
            meta[key] = item
    infos = []
    for _ in range(num_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, dims, gguf.GGMLQuantizationType(take("<I")), take("<Q")))
    align = meta.get("general.alignment", 32)
    start = (at + align - 1) // align * align
    tensors = {}
    for name, dims, qtype, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = list(reversed(dims))
        nbytes = int(np.prod(dims)) // block * size
        data = buf[start + offset:start + offset + nbytes]
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = data.view(np.float32 if qtype == gguf.GGMLQuantizationType.F32
                             else np.float16).reshape(shape)
        else:
            data = data.reshape(shape[:-1] + [shape[-1] // block * size])
        tensors[name] = (qtype, data)
    return meta, tensors


class GGUFDecoder:
    """The decoder a GGUF file holds, run in float32 (float64 for RoPE angles)."""

    def __init__(self, path: str) -> None:
        meta, tensors = read_gguf(path)
        self.arch = a = meta["general.architecture"]
        self.t = {name: gguf.quants.dequantize(data, qtype).astype(np.float32)
                  for name, (qtype, data) in tensors.items()}
        self.n_layer = meta[f"{a}.block_count"]
        self.n_embd = meta[f"{a}.embedding_length"]
        self.n_head = meta[f"{a}.attention.head_count"]
        self.n_head_kv = meta.get(f"{a}.attention.head_count_kv", self.n_head)
        self.n_rot = meta.get(f"{a}.attention.key_length", self.n_embd // self.n_head)
        self.eps = meta[f"{a}.attention.layer_norm_rms_epsilon"]
        self.base = meta.get(f"{a}.rope.freq_base", 10000.0)
        self.n_swa = meta.get(f"{a}.attention.sliding_window", 0)
        self.softcap = meta.get(f"{a}.final_logit_softcapping", 0.0)
        self.freq_scale = 1.0
        if meta.get(f"{a}.rope.scaling.type") == "linear":
            self.freq_scale = 1.0 / meta[f"{a}.rope.scaling.factor"]
        self.scale = 1.0 / np.sqrt(self.n_rot)
        if a == "gemma3":
            period = meta.get(f"{a}.attention.sliding_window_pattern", 6)
            self.swa = [il % period < period - 1 for il in range(self.n_layer)]
            self.base_swa = meta.get(f"{a}.rope.freq_base_swa", 10000.0)
        else:
            self.swa = [bool(self.n_swa)] * self.n_layer
            self.base_swa = self.base

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True)
                           + self.eps).astype(np.float32) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float, scale: float) -> np.ndarray:
        """x [S, heads, d]; llama: pairs (2j, 2j+1), else halves (j, j + d/2)."""
        d = x.shape[-1]
        theta = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        if "rope_freqs.weight" in self.t:
            theta = theta / self.t["rope_freqs.weight"].astype(np.float64)
        rot = np.exp(1j * (pos[:, None] * scale * theta[None, :]))[:, None, :]   # [S,1,d/2]
        if self.arch == "llama":
            z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = z.real, z.imag
            return out
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * rot
        return np.concatenate([z.real, z.imag], axis=-1).astype(np.float32)

    def _mm(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.t[name + ".weight"].T
        if name + ".bias" in self.t:
            y = y + self.t[name + ".bias"]
        return y

    def logits(self, tokens) -> np.ndarray:
        """float32 [len(tokens), vocab]: every position's logits, no cache."""
        t, ids = self.t, np.asarray(tokens)
        n, d = len(ids), self.n_rot
        pos = np.arange(n, dtype=np.float64)
        x = t["token_embd.weight"][ids]
        if self.arch == "gemma3":
            x = x * np.float32(np.sqrt(self.n_embd))
        for il in range(self.n_layer):
            p = f"blk.{il}."
            cur = self._norm(x, t[p + "attn_norm.weight"])
            if p + "attn_qkv.weight" in t:
                qkv = self._mm(cur, p + "attn_qkv")
                nq, nk = self.n_head * d, self.n_head_kv * d
                q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
            else:
                q, k, v = (self._mm(cur, p + f"attn_{w}") for w in "qkv")
            q = q.reshape(n, self.n_head, d)
            k = k.reshape(n, self.n_head_kv, d)
            v = v.reshape(n, self.n_head_kv, d)
            if p + "attn_q_norm.weight" in t:
                q = self._norm(q, t[p + "attn_q_norm.weight"])
                k = self._norm(k, t[p + "attn_k_norm.weight"])
            base, fscale = ((self.base_swa, 1.0) if self.swa[il] and self.arch == "gemma3"
                            else (self.base, self.freq_scale))
            q, k = self._rope(q, pos, base, fscale), self._rope(k, pos, base, fscale)
            out = np.empty((n, self.n_head, d), np.float32)
            group = self.n_head // self.n_head_kv
            for hq in range(self.n_head):
                hk = hq // group
                s = (q[:, hq] @ k[:, hk].T) * np.float32(self.scale)
                i, j = np.indices((n, n))
                masked = (j > i) | ((i - j >= self.n_swa) if self.swa[il] else False)
                s = np.where(masked, -np.inf, s)
                e = np.exp(s - s.max(-1, keepdims=True))
                out[:, hq] = (e / e.sum(-1, keepdims=True)) @ v[:, hk]
            attn = self._mm(out.reshape(n, -1), p + "attn_output")
            if p + "post_attention_norm.weight" in t:
                attn = self._norm(attn, t[p + "post_attention_norm.weight"])
            x = x + attn
            cur = self._norm(x, t[p + "ffn_norm.weight"])
            if p + "ffn_gate.weight" in t:
                gate, up = self._mm(cur, p + "ffn_gate"), self._mm(cur, p + "ffn_up")
            else:                                       # phi3: [gate; up] in ffn_up
                gate, up = np.split(self._mm(cur, p + "ffn_up"), 2, axis=-1)
            if self.arch == "gemma3":
                act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
            else:
                act = gate / (1 + np.exp(-gate))
            ffn = self._mm((act * up).astype(np.float32), p + "ffn_down")
            if p + "post_ffw_norm.weight" in t:
                ffn = self._norm(ffn, t[p + "post_ffw_norm.weight"])
            x = x + ffn
        x = self._norm(x, t["output_norm.weight"])
        head = t.get("output.weight", t["token_embd.weight"])
        out = x @ head.T
        if self.softcap:
            out = np.tanh(out / self.softcap) * self.softcap
        return out.astype(np.float32)

    def greedy(self, prompt, num_tokens: int) -> list[int]:
        """``num_tokens`` greedy tokens after ``prompt``, each from a full recompute."""
        seq = list(prompt)
        for _ in range(num_tokens):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(prompt):]
