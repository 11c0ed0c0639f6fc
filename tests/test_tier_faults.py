"""The disk tier against what else may sit in or happen to its directory:
special files and links at an entry's name, linked shard directories, a
full disk, refused permissions, a read that hangs, a first start that
fails while writing the secret.

Every risky call runs under a deadline (:func:`within`), and every test
checks that a fault is a miss or a failed store, never a wrong K/V (the
cache's K/V against a cache without tiers), and never a write outside the
tier's directory.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from pagedkv_np import ConfigError, PagedKVCache
from pagedkv_np.tiers import PageFormat, decode_page, encode_page

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4
PROMPT = list(range(100, 100 + 4 * PAGE + 3))     # 4 full pages and a tail
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE = 20.0


def within(seconds, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread; the test fails if it has not
    returned after ``seconds`` (the thread is left behind, as a daemon)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:       # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def make_cache(directory, **kw) -> PagedKVCache:
    kw.setdefault("num_pages", 32)
    return PagedKVCache(LAYERS, kw.pop("num_pages"), PAGE, HEADS, DIM, dtype="float32",
                        backend="numpy", disk_cache=str(directory), model_id="model-a", **kw)


def run_prompt(cache, prompt, expected_kv):
    """Add ``prompt`` (under a deadline), write the K/V of its uncached
    tokens; the sequence and the tokens served from the cache."""
    seq = within(DEADLINE, cache.add_sequence, prompt)
    return seq, finish(cache, seq, prompt, expected_kv)


def finish(cache, seq, prompt, expected_kv):
    """Write the K/V of the tokens of ``prompt`` that ``seq`` was not served."""
    n = seq.num_cached_tokens
    cache.extend(seq, prompt[n:])
    plan = cache.plan([seq])
    for layer in range(LAYERS):
        k, v = expected_kv(prompt, None, layer, HEADS, DIM, "float32")
        cache.write(layer, plan, np.ascontiguousarray(k[n:]), np.ascontiguousarray(v[n:]))
    return n


def gathered(cache, seq, num_tokens):
    plan = cache.plan([seq])
    return [tuple(a[0, :num_tokens] for a in cache.gather(layer, plan, layout="BTHD"))
            for layer in range(LAYERS)]


def assert_kv_of_a_cache_without_tiers(cache, seq, prompt, expected_kv):
    """The sequence's K/V, bit for bit, equals a tier-less cache's for ``prompt``."""
    ref = PagedKVCache(LAYERS, 32, PAGE, HEADS, DIM, dtype="float32", backend="numpy")
    ref_seq, _ = run_prompt(ref, prompt, expected_kv)
    for (k, v), (rk, rv) in zip(gathered(cache, seq, len(prompt)),
                                gathered(ref, ref_seq, len(prompt))):
        np.testing.assert_array_equal(k, rk)
        np.testing.assert_array_equal(v, rv)


def disk_stats(cache):
    return cache.stats.tiers["disk"]


def chain_paths(cache, prompt=PROMPT):
    """The entry file of each full page of ``prompt``, in chain order."""
    root = cache.tiers.tiers[0].root
    by_tokens = {}
    for d, _, names in os.walk(root):
        for name in names:
            if name.endswith(".page"):
                path = os.path.join(d, name)
                with open(path, "rb") as f:
                    by_tokens[decode_page(f.read()).tokens] = path
    return [by_tokens[np.array(prompt[i:i + PAGE], np.int64).tobytes()]
            for i in range(0, len(prompt) - PAGE + 1, PAGE)]


def written_prompt(directory, expected_kv):
    """A cache that wrote PROMPT's pages to ``directory``; their files."""
    a = make_cache(directory)
    run_prompt(a, PROMPT, expected_kv)
    assert a.tiers.flush(DEADLINE)
    paths = chain_paths(a)
    assert len(paths) == 4
    a.tiers.close()
    return paths


def files_under(path):
    """Every name under ``path`` (links not followed)."""
    return sorted(os.path.join(d, n) for d, dirs, names in os.walk(path) for n in dirs + names)


def entry_nbytes():
    """Bytes of one entry of make_cache's pages."""
    fmt = PageFormat.from_store(PagedKVCache(LAYERS, 2, PAGE, HEADS, DIM, dtype="float32",
                                             backend="numpy").store)
    arrays = [np.zeros(shape, dtype) for shape, dtype in fmt.parts]
    return len(encode_page(b"k" * 20, b"d" * 16, b"p" * 16, b"t" * 8 * PAGE, fmt.descr, arrays))


# ------------------------------------------- special files at an entry's name
def _fifo(path, outside):
    os.mkfifo(path)


def _dev_zero_link(path, outside):
    os.symlink("/dev/zero", path)


def _dev_zero_node(path, outside):
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))


def _socket(path, outside):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = os.getcwd()
    os.chdir(os.path.dirname(path))       # a socket's path must be short
    try:
        sock.bind(os.path.basename(path))
    finally:
        os.chdir(cwd)
    return sock


def _directory(path, outside):
    os.mkdir(path)


def _link_out(path, outside):
    """The true entry moved outside the tier, and linked to: still never followed."""
    target = os.path.join(outside, "moved.page")
    os.replace(path, target)
    os.symlink(target, path)


def _huge(path, outside):
    """A (sparse) regular file far larger than an entry."""
    with open(path, "r+b") as f:
        f.truncate(1 << 30)


SPECIALS = {"fifo": _fifo, "dev-zero-link": _dev_zero_link, "dev-zero-node": _dev_zero_node,
            "socket": _socket, "directory": _directory, "link-out": _link_out, "huge": _huge}


def _unblock(path):
    """Wake a reader stuck opening the FIFO at ``path`` (the unfixed tier)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("kind", list(SPECIALS))
def test_a_special_file_at_an_entry_is_a_miss(tmp_path, expected_kv, kind):
    """The third page's entry replaced: the first two pages load, the third
    is a miss that neither hangs, nor reads without end, nor counts as an
    error; the K/V is right, the page is written again where it can be, and
    nothing outside the directory changes."""
    directory, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    paths = written_prompt(directory, expected_kv)
    if kind not in ("link-out", "huge"):
        os.remove(paths[2])
    keep = SPECIALS[kind](paths[2], str(outside))
    before = {p: os.lstat(p) for p in files_under(outside)}
    b = make_cache(directory)
    try:
        seq, n = run_prompt(b, PROMPT, expected_kv)
    finally:
        if kind == "fifo":
            _unblock(paths[2])
    assert n == 2 * PAGE
    s = disk_stats(b)
    assert (s["hits"], s["misses"], s["rejected"], s["errors"]) == (2, 2, 0, 0)
    assert_kv_of_a_cache_without_tiers(b, seq, PROMPT, expected_kv)
    assert b.tiers.flush(DEADLINE)
    if kind == "directory":      # cannot be renamed over: a failed store, counted
        assert os.path.isdir(paths[2]) and disk_stats(b)["errors"] >= 1
    else:                        # the recomputed page replaced what sat there
        assert stat.S_ISREG(os.lstat(paths[2]).st_mode)
        c = make_cache(directory)
        seq, n = run_prompt(c, PROMPT, expected_kv)
        assert n == 4 * PAGE
        assert_kv_of_a_cache_without_tiers(c, seq, PROMPT, expected_kv)
    assert {p: os.lstat(p) for p in files_under(outside)} == before
    if keep is not None:
        keep.close()


def test_a_link_to_another_entry_is_never_followed(tmp_path, expected_kv):
    paths = written_prompt(tmp_path, expected_kv)
    os.remove(paths[1])
    os.symlink(paths[0], paths[1])
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    assert n == PAGE and disk_stats(b)["rejected"] == 0
    assert_kv_of_a_cache_without_tiers(b, seq, PROMPT, expected_kv)


# ----------------------------------------------------- linked shard directories
def test_linked_shard_directories_are_never_written_through(tmp_path, expected_kv):
    """Every shard directory a link to a directory outside the tier: pages
    go to real shard directories that replace the links, none lands
    outside, and the bytes the tier reports are the bytes it holds, within
    its bound of three entries."""
    directory, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    root = directory / "pages-v1"
    root.mkdir(parents=True)
    for i in range(256):
        os.symlink(outside, root / f"{i:02x}")
    bound = 3 * entry_nbytes()
    cache = make_cache(directory, disk_cache_bytes=bound, num_pages=64)
    rng = np.random.default_rng(5)
    for _ in range(25):                       # 100 pages
        prompt = rng.integers(0, 1000, 4 * PAGE + 1).tolist()
        seq, _ = run_prompt(cache, prompt, expected_kv)
        cache.release(seq)
    assert cache.tiers.flush(DEADLINE)
    assert files_under(outside) == []
    disk = cache.tiers.tiers[0]
    held = [p for p in files_under(root) if stat.S_ISREG(os.lstat(p).st_mode)]
    assert held and all(os.path.realpath(p).startswith(str(root) + os.sep) for p in held)
    assert disk.num_bytes == sum(os.lstat(p).st_size for p in held) <= bound
    assert disk_stats(cache)["pages_written"] >= 25


def test_a_linked_pages_directory_is_replaced(tmp_path, expected_kv):
    directory, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    directory.mkdir()
    os.symlink(outside, directory / "pages-v1")
    cache = make_cache(directory)
    run_prompt(cache, PROMPT, expected_kv)
    assert cache.tiers.flush(DEADLINE)
    assert files_under(outside) == []
    assert not os.path.islink(directory / "pages-v1") and len(chain_paths(cache)) == 4


# ---------------------------------------------------- full disks, permissions
def _fd_under(fd, directory):
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    except OSError:
        return False


def _failing_write(directory, err):
    """os.write, failing with ``err`` on files under ``directory``."""
    real = os.write

    def write(fd, data):
        if _fd_under(fd, directory):
            raise OSError(err, os.strerror(err))
        return real(fd, data)
    return write


def _failing_open(directory, err, match):
    """os.open, failing with ``err`` on entries and temporary files under
    ``directory`` opened with flags for which ``match(flags)`` holds."""
    real = os.open

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        under = (str(path).startswith(str(directory)) if dir_fd is None
                 else _fd_under(dir_fd, directory))
        if under and match(flags) and str(path).endswith((".page", ".tmp")):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, flags, mode, dir_fd=dir_fd)
    return open_


def test_a_full_disk_is_a_failed_store(tmp_path, expected_kv, monkeypatch):
    """Every write of the tier fails with ENOSPC: nothing is stored or left
    behind half written, each failure is counted, the K/V is right; once
    there is room again the pages are written."""
    directory = tmp_path / "tier"
    cache = make_cache(directory)
    monkeypatch.setattr(os, "write", _failing_write(directory, errno.ENOSPC))
    seq, n = run_prompt(cache, PROMPT, expected_kv)
    assert cache.tiers.flush(DEADLINE)
    s = disk_stats(cache)
    assert s["pages_written"] == 0 and s["errors"] >= 4 and s["drops"] >= 4
    assert not [p for p in files_under(directory) if p.endswith((".page", ".tmp"))]
    assert_kv_of_a_cache_without_tiers(cache, seq, PROMPT, expected_kv)
    monkeypatch.undo()
    cache.release(seq)
    again = make_cache(directory)
    seq, n = run_prompt(again, PROMPT, expected_kv)
    assert n == 0
    assert again.tiers.flush(DEADLINE) and disk_stats(again)["pages_written"] == 4


@pytest.mark.parametrize("denied", ["read", "write"])
def test_refused_permissions_are_misses_and_failed_stores(tmp_path, expected_kv, monkeypatch,
                                                          denied):
    """EACCES on opening entries (chmod does not stop root, so it is
    injected): reads are misses, writes failed stores, the K/V is right."""
    paths = written_prompt(tmp_path, expected_kv)
    if denied == "write":
        for p in paths:
            os.remove(p)
    b = make_cache(tmp_path)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    match = (lambda fl: fl & os.O_CREAT) if denied == "write" else (lambda fl: not fl & writes)
    monkeypatch.setattr(os, "open", _failing_open(tmp_path, errno.EACCES, match))
    seq, n = run_prompt(b, PROMPT, expected_kv)
    assert n == 0
    assert_kv_of_a_cache_without_tiers(b, seq, PROMPT, expected_kv)
    assert b.tiers.flush(DEADLINE)
    s = disk_stats(b)
    if denied == "write":
        assert s["pages_written"] == 0 and s["errors"] >= 4
        assert not [p for p in files_under(tmp_path) if p.endswith((".page", ".tmp"))]
    else:
        assert s["hits"] == 0 and s["rejected"] == 0


# ---------------------------------------------------------- a read that hangs
def test_a_hung_read_holds_add_sequence_one_read_timeout_at_most(tmp_path, expected_kv):
    """A tier read that never returns: add_sequence gives up after
    read_timeout (a miss), the next ones skip the tier at once while it
    hangs, and once it returns the tier serves again."""
    written_prompt(tmp_path, expected_kv)
    b = make_cache(tmp_path, tier_options={"read_timeout": 0.3})
    disk = b.tiers.tiers[0]
    release, entered = threading.Event(), threading.Event()
    real_get = disk.get

    def hung_get(keys):
        entered.set()
        release.wait()
        return real_get(keys)

    disk.get = hung_get
    try:
        t0 = time.monotonic()
        first = within(DEADLINE, b.add_sequence, PROMPT)
        assert entered.is_set() and time.monotonic() - t0 < 0.3 + 5.0
        assert first.num_cached_tokens == 0
        t0 = time.monotonic()
        second = within(DEADLINE, b.add_sequence, PROMPT)
        assert second.num_cached_tokens == 0 and time.monotonic() - t0 < 0.25
    finally:
        release.set()
    disk.get = real_get
    b.release(first)
    b.release(second)
    deadline = time.monotonic() + DEADLINE
    while True:                  # the reader is free once the hung call has returned
        seq = within(DEADLINE, b.add_sequence, PROMPT)
        if seq.num_cached_tokens or time.monotonic() > deadline:
            break
        b.release(seq)           # nothing written: nothing indexed in RAM
        time.sleep(0.05)
    assert seq.num_cached_tokens == 4 * PAGE and disk_stats(b)["hits"] == 4
    finish(b, seq, PROMPT, expected_kv)
    assert_kv_of_a_cache_without_tiers(b, seq, PROMPT, expected_kv)


# ------------------------------------------------------------------ the secret
START = textwrap.dedent("""
    import json, resource, signal, sys
    from pagedkv_np import PagedKVCache
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))   # a full disk
    try:
        PagedKVCache(2, 8, 4, 2, 8, backend="numpy", disk_cache=sys.argv[1], model_id="m")
        print(json.dumps(["started"]))
    except Exception as exc:
        print(json.dumps([type(exc).__name__, str(exc)]))
""")


def test_a_first_start_on_a_full_disk_leaves_no_secret_and_the_next_start_works(tmp_path):
    """The secret cannot be written (files past 16 bytes fail with EFBIG, as
    a full disk fails with ENOSPC): the start raises ConfigError naming the
    secret, leaves neither it nor a temporary file, and a start with room
    makes a 32-byte secret that the next start reads."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", START, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, message = json.loads(proc.stdout.strip().splitlines()[-1])
    assert name == "ConfigError" and os.path.join(str(tmp_path), "secret") in message
    assert [n for n in os.listdir(tmp_path) if n.startswith("secret")] == []
    cache = within(DEADLINE, make_cache, tmp_path)
    with open(tmp_path / "secret", "rb") as f:
        secret = f.read()
    assert len(secret) == 32 and cache.index.secret == secret
    assert within(DEADLINE, make_cache, tmp_path).index.secret == secret


def test_a_failed_write_of_the_secret_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "write", _failing_write(tmp_path, errno.ENOSPC))
    with pytest.raises(ConfigError, match="secret"):
        within(DEADLINE, make_cache, tmp_path)
    monkeypatch.undo()
    assert [n for n in os.listdir(tmp_path) if n.startswith("secret")] == []
    assert len(within(DEADLINE, make_cache, tmp_path).index.secret) == 32


def test_an_empty_secret_left_by_an_earlier_failed_start_is_replaced(tmp_path):
    (tmp_path / "secret").write_bytes(b"")
    cache = within(DEADLINE, make_cache, tmp_path)
    assert (tmp_path / "secret").read_bytes() == cache.index.secret and len(
        cache.index.secret) == 32


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "directory", "short"])
def test_a_secret_that_is_not_one_is_a_config_error_not_a_hang(tmp_path, kind):
    path = str(tmp_path / "secret")
    if kind == "short":
        with open(path, "wb") as f:
            f.write(b"x" * 5)
    else:
        SPECIALS[kind](path, None)
    try:
        with pytest.raises(ConfigError, match="secret"):
            within(DEADLINE, make_cache, tmp_path)
    finally:
        if kind == "fifo":
            _unblock(path)
