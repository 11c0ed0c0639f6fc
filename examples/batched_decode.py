"""Decode steps of a batch that changes: the loop a model runner writes.

Three requests share a system prompt; each step feeds every running request
its last token, one request joins mid-way and one leaves early. The K/V is
made up (a real loop takes it from the model's layers), so that the check at
the end can say exactly what the cache must hold.
Run: python examples/batched_decode.py
"""

import numpy as np

from pagedkv_np import PagedKVCache

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 4


def fake_kv(tokens, positions, layer):
    """Deterministic stand-in for a layer's K of ``tokens`` at ``positions``."""
    base = (np.asarray(tokens) * 1000 + np.asarray(positions) * 10 + layer).astype(np.float32)
    return np.broadcast_to(base[:, None, None], (len(tokens), NUM_KV_HEADS, HEAD_DIM)).copy()


def run_layers(cache, plan, seqs):
    """One model call: write each layer's new K/V (V = -K here), then read the
    batch's whole past back as attention would."""
    new_tokens, new_positions = [], []
    for b, seq in enumerate(seqs):
        start, stop = int(plan.context_lens[b]), int(plan.seq_lens[b])
        new_tokens += seq.tokens[start:stop].tolist()
        new_positions += range(start, stop)
    for layer in range(NUM_LAYERS):
        k = fake_kv(new_tokens, new_positions, layer)
        cache.write(layer, plan, k, -k)
        past_k, _ = cache.gather(layer, plan, layout="BHTD")   # [B, H, T, D]
    return past_k


def main():
    # HND pages keep each head's positions together, as the BHTD gathers below want
    cache = PagedKVCache(NUM_LAYERS, 32, 8, NUM_KV_HEADS, HEAD_DIM, dtype="float32",
                         layout="HND")
    system = list(range(100, 120))                       # a 20-token system prompt
    prompts = {"a": system + [1, 2], "b": system + [3], "c": system + [4, 5, 6]}
    budgets = {"a": 12, "b": 4, "c": 6}                   # tokens each request generates
    joins = {"a": 0, "b": 0, "c": 3}                      # the step each one arrives at
    running, generated, step = {}, {}, 0
    while len(generated) < len(prompts) or running:
        # arrivals: a prefill of the part of the prompt the cache lacks
        for name in [n for n, s in joins.items() if s == step]:
            seq = cache.add_sequence(prompts[name])
            cache.extend(seq, prompts[name][seq.num_cached_tokens:])
            run_layers(cache, cache.plan([seq]), [seq])
            print(f"step {step}: {name} joins, {seq.num_cached_tokens} of "
                  f"{len(prompts[name])} prompt tokens from the cache")
            running[name], generated[name] = seq, [7 * len(name) + step]
        # a decode step: one token per running request, one plan for all layers
        names = list(running)
        seqs = [running[n] for n in names]
        cache.extend_batch(seqs, [generated[n][-1] for n in names])
        past = run_layers(cache, cache.plan(seqs), seqs)
        for b, name in enumerate(names):
            n = seqs[b].num_tokens
            # the gathered past is this request's own tokens, and zeros after
            want = fake_kv(seqs[b].tokens, np.arange(n), NUM_LAYERS - 1)[:, 0, 0]
            assert np.array_equal(past[b, 0, :n, 0], want) and not past[b, :, n:].any()
            generated[name].append((generated[name][-1] * 31 + step) % 97)
            if len(generated[name]) == budgets[name]:
                cache.release(running.pop(name))   # its full pages stay cached
                print(f"step {step}: {name} leaves after {budgets[name]} tokens")
        step += 1
    stats = cache.stats
    print(f"{step} steps; prefix hit rate {stats.prefix_hit_rate:.0%}, "
          f"{stats.pages_evictable} pages kept for later requests")
    cache.check_invariants()


if __name__ == "__main__":
    main()
