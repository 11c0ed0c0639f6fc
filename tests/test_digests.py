"""The one file-digest memo (pagedkv_np.digests): a file is hashed once, and a
different file put in its place is hashed again even when size and mtime are
the same (cp -p, rsync -t, os.utime), in this process and from the memo a new
process reads; the GGUF importer then builds the new model's folder, and the
tier fingerprint changes so that no page of the old model is served."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pagedkv_np.digests import MEMO_SUBDIR, file_digest, save_deferred
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.models.graph import reference_logits
from pagedkv_np.models.testmodel import build_model, save_model

from test_gguf_import import _logits, _session, write_gguf
from test_tier_disk import CONFIG, NEW, PROMPTS, decoder, disk_stats, reference


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _overwrite(path, data: bytes) -> None:
    """Write ``data`` over the file in place and put its mtime back, as
    ``cp -p`` onto an existing file does."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _digest_in_new_process(path, memo_dir) -> str:
    code = ("import sys; from pagedkv_np.digests import file_digest; "
            "print(file_digest(sys.argv[1], sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(memo_dir)], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def test_a_file_is_hashed_once_per_identity(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(300_000))
    memo = tmp_path / "memo"
    memo.mkdir()
    assert file_digest(path, memo) == _sha(path)
    (saved,) = (memo / MEMO_SUBDIR).iterdir()
    entry = json.loads(saved.read_text())
    assert entry["identity"]["size"] == 300_000 and entry["sha256"] == _sha(path)
    # a memo is believed while the identity matches: a new process reads it back
    saved.write_text(json.dumps({**entry, "sha256": "e" * 64}))
    assert _digest_in_new_process(path, memo) == "e" * 64


def test_same_size_other_bytes_with_the_mtime_put_back(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 200_000)
    memo = tmp_path / "memo"
    memo.mkdir()
    first = file_digest(path, memo)
    # the bytes differ only where no sample looks: only the ctime tells them apart
    _overwrite(path, b"a" * 100_000 + b"b" + b"a" * 99_999)
    assert os.path.getsize(path) == 200_000
    assert file_digest(path, memo) == _sha(path) != first
    assert _digest_in_new_process(path, memo) == _sha(path)


def test_a_file_replaced_by_rename_with_its_mtime(tmp_path):
    """rsync -t: a new file renamed over the old one, with the old mtime."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 70_000)
    first = file_digest(path, tmp_path)
    st = os.stat(path)
    other = tmp_path / "f.tmp"
    other.write_bytes(b"y" * 70_000)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert file_digest(path, tmp_path) == _sha(path) != first
    assert _digest_in_new_process(path, tmp_path) == _sha(path)


def test_a_missing_memo_dir_waits_for_save_deferred(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"z" * 1000)
    memo = tmp_path / "later"
    assert file_digest(path, memo) == _sha(path)
    assert not memo.exists()
    memo.mkdir()
    save_deferred(memo)
    (saved,) = (memo / MEMO_SUBDIR).iterdir()
    assert json.loads(saved.read_text())["sha256"] == _sha(path)


def test_a_gguf_replaced_in_place_is_imported_again(tmp_path):
    """A same-size GGUF of other weights copied over the first, mtime restored:
    the importer serves the new model's folder (other tokens), in this process
    and in a new one."""
    spec = write_gguf(tmp_path / "m.gguf", seed=0, tied=False)
    cache = tmp_path / "cache"
    first = import_gguf(spec.path, cache_dir=cache)
    other = write_gguf(tmp_path / "other.gguf", seed=9, tied=False)
    data = Path(other.path).read_bytes()
    assert len(data) == os.path.getsize(spec.path)
    _overwrite(spec.path, data)
    second = import_gguf(spec.path, cache_dir=cache)
    assert second != first
    tokens = np.random.default_rng(1).integers(0, other.geometry.vocab_size, 20).tolist()
    want = reference_logits(other.geometry, other.reference, tokens)
    got = _logits(_session(second), tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) != _logits(_session(first), tokens).argmax(-1)).any()
    code = ("import sys; from pagedkv_np.models.gguf.importer import import_gguf; "
            "print(import_gguf(sys.argv[1], cache_dir=sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, spec.path, str(cache)], check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == str(second)


def test_the_tier_fingerprint_follows_a_file_replaced_in_place(tmp_path):
    """Other weights of the same size written over the model, mtime restored: a
    new fingerprint, so the disk tier serves none of the old model's pages."""
    path = str(tmp_path / "m.onnx")
    save_model(build_model(CONFIG), path)
    first = decoder(path, tmp_path / "d")
    first.generate(PROMPTS[:1], NEW)
    first.cache.tiers.flush(30)
    other = str(tmp_path / "other.onnx")
    save_model(build_model(CONFIG, seed=7), other)
    _overwrite(path, Path(other).read_bytes())
    second = decoder(path, tmp_path / "d")
    assert second.cache.tiers.model_id != first.cache.tiers.model_id
    assert second.generate(PROMPTS[:1], NEW) == [reference(path, PROMPTS[0])]
    assert disk_stats(second)["hits"] == 0
