"""The batching loop of :class:`~pagedkv_np.onnxruntime.OrtDecoder`: which
requests run, their decode steps and prefills, and what happens when one fails.

One :meth:`Batcher.step` does, in order::

    decode   every running request feeds its last token (one model call for
             the batch); if the pool cannot give each one a slot, the
             youngest requests are preempted (pages released into the
             prefix index, recomputed later from prompt + generated tokens)
    admit    waiting requests, oldest first, while the batch has room and the
             pool has pages; each prefills only the part of its prompt the
             prefix index does not hold (one model call per request)

The runner keeps the decode batch's past K/V between steps; the new tokens'
K/V reaches the pages every ``write_interval`` steps and before anything
reads or releases those pages (see :mod:`pagedkv_np.onnxruntime.engine`).

A prompt's K/V stays in the runner's prompt buffers while it is fed and
reaches the pages after its last chunk, layer by layer, each layer's buffer
handed back once written, so that the two copies never coexist in full.
Where the pages hold K/V in the model's own dtype, a prompt fed to its end
is not written then: fed alone, its buffers become its decode buffers; fed
beside running requests (a runner whose rows keep positions at their
index), its K/V waits there and the next decode batch copies it into the
prompt's row, handing each layer back once copied. Either way it is *held*:
its K/V reaches the pages when that batch ends or changes, a waiting
request is admitted, or the request is preempted or aborted (and at once
when it finished at its first token or another prompt is fed first). So a
long prompt holds its K/V once whether it decodes alone or among others
(SmolLM2-135M, a 4,564-token prompt and 16 tokens after it, alone: peak
resident 714 MiB against 910 with every chunk written at once). The other
rows of a batch are gathered from the pages each alone, below their own
length, so no row is padded in memory to the longest. A prompt given up
midway (preempted, failed, interrupted) writes the chunks it fed first,
which stay cached.

When a step fails, only the requests it concerns end:

- A failure that belongs to one request (its prefill: model call, prefix
  gather, page reservation, plan or write; its sampling; a decode step it
  ran alone) finishes that request with ``finish_reason == "error"``; its
  pages are released and its tokens kept.
- A decode step of a batch that fails cannot tell which request caused it:
  each request of the batch runs again alone, once, in the same step. When
  what failed leaves the model's buffers and the pages apart (a page write
  or slot reservation), the batch's requests are recomputed instead, and
  each one's next decode step runs alone. Only a request that fails alone
  fails, and every retry follows progress, so nothing is retried forever.
- An interrupt (``KeyboardInterrupt``, ``SystemExit``) propagates after
  every running request went back to the queue, to be recomputed; K/V not
  yet written is never indexed.

Longer than this package's modules usually are, on purpose: admission,
prefill, decode, preemption, the prompt writes and every failure path are
transitions of one state (the running batch, the prompt being fed, what is
written), which this module keeps in one place so that each path can be
read beside the others.
"""

from __future__ import annotations

import collections

import numpy as np

from ..cache import PagedKVCache
from ..errors import RequestFailed
from .chunking import ChunkBudget, Prefill, chunk_rows
from .requests import Request, StepEvents
from .batch_gather import batch_gather
from .runners import Runner

__all__ = ["Batcher"]

# The GQA decode buffer holds at most this many positions beyond the longest
# sequence; a longer run is re-gathered into a larger buffer.
_MAX_HEADROOM = 512


class Batcher:
    """The queue, the running batch and their steps, over one cache and runner.

    Invariants between steps: a request is in at most one of ``waiting`` and
    ``running``; a running request holds a live sequence (``req.seq``), a
    finished or waiting one none; the runner's buffers hold the requests of
    ``_batch``, whose last ``_pending`` decode steps are not yet in the pages.

    Parameters
    ----------
    cache : PagedKVCache
    runner : Runner
    max_batch_size, write_interval : int
    max_positions : int or None
        Caps the GQA decode buffers.
    counters : dict
        Updated in place (the decoder's ``stats``).
    chunks : ChunkBudget
        Prompt tokens a step feeds (:mod:`pagedkv_np.onnxruntime.chunking`).
    two_fed : bool
        The prefix cache serves all but two of a prompt's tokens at most
        (else one): its last token then never runs through the model alone,
        whose K/V would differ in the last bits from a chunk's (see
        :func:`~pagedkv_np.onnxruntime.chunking.chunk_rows`). For int8 decode
        steps, which turn such bits into other tokens; a prompt a token past
        its cached pages then recomputes a page (one token with
        ``partial_page_reuse``).
    """

    def __init__(self, cache: PagedKVCache, runner: Runner, max_batch_size: int,
                 write_interval: int, max_positions: int | None, counters: dict,
                 chunks: ChunkBudget | None = None, two_fed: bool = False) -> None:
        self.cache = cache
        self.two_fed = two_fed
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.write_interval = write_interval
        self.chunks = chunks or ChunkBudget()
        self.prefilling: Prefill | None = None   # the prompt being fed
        self.max_positions = max_positions
        self.counters = counters
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # finished requests of the batch whose K/V reaches the pages with its next
        # flush, at the start of the next step: not while their last token waits
        self.retiring: list[Request] = []
        self.finished_log: list[Request] = []   # finished since the last step returned
        self._batch_rids: tuple[int, ...] | None = None
        self._batch: list[Request] = []   # the requests in the runner's buffers
        self._pending = 0                 # their decode steps not yet in the pages
        # rids of the batch's rows whose K/V is not in the pages beyond their
        # pending steps: a prompt adopted or joined (see _feed), written when the batch ends
        self._held: set[int] = set()
        # a prompt fed to its end beside running requests, its K/V kept by the
        # runner until the next batch copies it into its row (or it is written)
        self._joining: Prefill | None = None
        # pages give back the model's own K/V bits (no int8 or float16 rounding): only
        # then may a prompt decode in its own buffers instead of what the pages return
        self._exact_pages = np.dtype(cache.dtype) == np.dtype(runner.io.dtype)

    def step(self) -> StepEvents:
        """One decode step of the running requests, then admissions."""
        events = StepEvents()
        try:
            self.settle()
            decoding = bool(self.running)
            preempted = self.decode(events)
            if not preempted:
                self.admit(events, decoding)
        except BaseException:
            # an interrupt (per-request failures are handled where they
            # happen): nothing half done stays; what finished before it is
            # reported by the next step
            self.requeue_running()
            raise
        if not self.running and not self.retiring:
            self.forget_batch()
        events.finished = frozenset(r.rid for r in self.finished_log)
        events.errors = {r.rid: r.error for r in self.finished_log if r.error is not None}
        events.statuses = {r.rid: r.status() for r in self.finished_log}
        self.finished_log.clear()
        return events

    def settle(self) -> None:
        """Write the retiring requests' K/V (with the rest of the batch's
        pending steps) and release their pages."""
        if self.retiring:
            self.flush(ending=True)

    def abort(self, req: Request) -> None:
        """End ``req`` now (it is not finished); its pages go back to the pool."""
        if self.prefilling is not None and self.prefilling.req is req:
            try:                          # an interrupt in its write still ends it
                self._close_prefill(requeue=False)
            finally:
                self.finish(req, "abort")
            return
        if self._joining is not None and self._joining.req is req:
            self._settle_joining()        # its prompt's K/V stays cached
        if req.seq is not None and req in self._batch:
            self.flush(ending=True)       # its decoded K/V stays cached
        if req in self.waiting:          # also where a failed flush puts it
            self.waiting.remove(req)
        if req.finished:       # a failed flush ended it
            return
        if req.seq is not None:
            self.running.remove(req)
            self.cache.release(req.seq)
            req.seq = None
        self.finish(req, "abort")

    def finish(self, req: Request, reason: str, cause: BaseException | None = None) -> None:
        req.finish_reason = reason
        if cause is not None:
            req.error = RequestFailed(req.rid, cause)
            self.counters["num_failed_requests"] += 1
        self.finished_log.append(req)
        self.waiting.extendleft(req.hand_over_forks())   # its continuations go on without it

    def _accept(self, req: Request, token: int, events: StepEvents) -> None:
        reason = req.accept(token, events)
        self.counters["num_generated_tokens"] += 1
        if reason is not None:
            self.finish(req, reason)

    def _retire_finished(self) -> None:
        """Release the finished requests' pages; those of the batch keep
        theirs until the batch's K/V is written, at the next step's start
        (:attr:`retiring`), so that their last token does not wait for it
        (a long prompt decoded alone: its whole K/V, 170 ms for Gemma 3 at
        4,096 positions)."""
        if self._joining is not None and self._joining.req.finished:
            self._settle_joining()
        if any(r.finished for r in self.running):
            for req in self.running:
                if req.finished and req.seq is not None:
                    if req in self._batch:
                        self.retiring.append(req)
                    else:
                        self.cache.release(req.seq)
                        req.seq = None
            self.running = [r for r in self.running if not r.finished]

    def _preempt(self, req: Request) -> None:
        if self._joining is not None and self._joining.req is req:
            self._settle_joining()
        if req in self._batch:
            self.flush(ending=True)
        if req.seq is None:      # a failed flush took it out already
            return
        self.running.remove(req)
        self.cache.release(req.seq)   # its full pages stay cached for the recompute
        req.seq = None
        self.waiting.appendleft(req)
        self.counters["num_preemptions"] += 1

    def forget_batch(self) -> None:
        """The runner's buffers go; so do the retiring requests' pages (their
        K/V was written by the flush before, or is never indexed)."""
        for req in self.retiring:
            if req.seq is not None and not req.seq.is_released:
                self.cache.release(req.seq)
            req.seq = None
        self.retiring = []
        self.runner.reset()
        self._batch_rids = None
        self._batch = []
        self._pending = 0
        self._held = set()

    def requeue_running(self) -> None:
        """After an interrupt: every running request that is not finished goes
        back to the queue, to be recomputed; K/V not yet written is never
        indexed."""
        self._close_prefill(requeue=True)
        self._joining = None             # its K/V was never written: never indexed
        self.runner.forget_prompt()
        for req in reversed(self.running):
            if req.seq is not None and not req.seq.is_released:
                self.cache.release(req.seq)
            req.seq = None
            if not req.finished:
                self.waiting.appendleft(req)
        self.running = []
        self.forget_batch()

    def _drop_batch(self, cause: BaseException) -> None:
        """The batch's decoded K/V cannot reach the pages: release its
        requests, to be recomputed and then decoded alone (a batch of one
        fails instead). Requests that had finished keep their tokens."""
        batch, alone = self._batch, len(self._batch) == 1
        self.forget_batch()
        self.counters["num_batch_failures"] += 1
        requeue = []
        for req in batch:
            if req.seq is None:
                continue
            self.cache.release(req.seq)
            req.seq = None
            self.running.remove(req)
            if req.finished:
                continue
            if alone:
                self.finish(req, "error", cause)
            else:
                req.isolate = True
                requeue.append(req)
        self.waiting.extendleft(reversed(requeue))

    def flush(self, ending: bool = False) -> bool:
        """Write the K/V of the batch's pending decode steps into the pages;
        ``ending``: the batch is not decoded again, so its held rows (a
        prompt adopted or joined, all of it past its cached prefix) are
        written too, each layer's buffers are handed back once written and
        the batch is forgotten. Without ``ending`` held rows wait: written
        now, their K/V would be held twice.

        Returns False when that failed and the batch was dropped.
        """
        rows = [b for b, r in enumerate(self._batch) if ending or r.rid not in self._held]
        if not rows or not (self._pending or (ending and self._held)):
            if ending:
                self.forget_batch()
            else:
                self._pending = 0
            return True
        cache, runner, plan = self.cache, self.runner, None
        try:
            # each row's new tokens: its pending steps, or a held row's whole past its prefix
            plan = cache.plan([self._batch[b].seq for b in rows])
            recent = None
            if not runner.positional and not self._held:
                recent = runner.recent_kv(self._pending)
            for layer in range(cache.num_layers):
                if runner.positional:
                    k, v = runner.rows_kv(layer, rows, plan.context_lens, plan.seq_lens)
                elif recent is None:       # an adopted prompt: one row
                    k, v = runner.solo_kv(layer, int(plan.context_lens[0]),
                                          int(plan.seq_lens[0]))
                else:
                    k, v = recent[layer]
                cache.write(layer, plan, k, v)
                if ending:
                    runner.drop_batch_layer(layer)
        except BaseException as exc:
            if plan is not None and not cache.is_written(plan):
                cache.discard(plan)
            if not isinstance(exc, Exception):
                raise
            self._drop_batch(exc)
            return False
        self._pending = 0
        if ending:
            self.forget_batch()
        return True

    def decode(self, events: StepEvents) -> bool:
        """One token for every running request; returns whether any was preempted."""
        cache, preempted = self.cache, False
        while self.running:
            if cache.can_extend_batch([r.seq for r in self.running]):
                break
            # youngest first: the open prompt, then the running requests, so
            # that the oldest always advance
            if self.prefilling is not None:
                self._close_prefill(requeue=True)
            else:
                self._preempt(self.running[-1])
            preempted = True
        if not self.running:
            return preempted
        # requests whose batch failed run alone, then the rest together
        groups = [[r] for r in self.running if r.isolate]
        rest = [r for r in self.running if not r.isolate]
        if rest:
            groups.append(rest)
        while groups:
            groups.extend(self._decode_group(groups.pop(0), events))
        self._retire_finished()
        return preempted

    def _decode_group(self, reqs: list[Request], events: StepEvents) -> list[list[Request]]:
        """One decode step of ``reqs`` together; returns the groups to run
        again (each request alone, after a failure of the group)."""
        reqs = [r for r in reqs if r.seq is not None and not r.finished]
        if not reqs:
            return []
        cache = self.cache
        # This runs once per token: plain Python for the batch's few numbers,
        # since each NumPy call here costs more than its work (the model has
        # just pushed the interpreter out of the CPU's caches).
        seqs = [r.seq for r in reqs]
        len_list = [s.num_tokens for s in seqs]
        rids = tuple(r.rid for r in reqs)
        if rids != self._batch_rids or self.runner.needs_gather(max(len_list)):
            if not self.flush(ending=True):
                return []    # the old batch was dropped; the rest decode next step
            joining = self._joining if self._joining is not None and \
                self._joining.req in reqs else None
            try:
                row = None if joining is None else reqs.index(joining.req)
                self.runner.start_batch(batch_gather(cache, seqs, len_list, self.runner, row),
                                        np.array(len_list, dtype=np.int64),
                                        self._capacity(reqs, max(len_list)))
            except Exception as exc:
                self.forget_batch()
                if joining is not None:
                    self._lose_joining()      # to be recomputed, not failed
                    if len(reqs) == 1:
                        return []
                return self._group_failed(reqs, exc)
            self._batch_rids, self._batch = rids, list(reqs)
            if joining is not None:       # its row holds the prompt now, not in the pages
                self._joining = None
                self.runner.forget_prompt()
                self._held = {joining.req.rid}
            self.counters["num_regathers"] += 1
        lens = np.array(len_list, dtype=np.int64)
        tokens = np.array([r.generated[-1] for r in reqs], dtype=np.int64)
        try:
            # all or nothing: on failure the runner's buffers hold the batch's
            # pending K/V as before, and the pages have nothing of this step
            logits = self.runner.decode(tokens, lens)
        except Exception as exc:
            return self._group_failed(reqs, exc)
        try:
            cache.extend_batch(seqs, tokens)
        except Exception as exc:
            # the model's buffers are a token ahead of the pages
            self._drop_batch(exc)
            return []
        self._pending += 1
        self.counters["num_decode_steps"] += 1
        greedy = logits.argmax(axis=-1).tolist()   # one call for the batch's greedy rows
        for b, r in enumerate(reqs):
            r.isolate = False
            try:
                token = greedy[b] if r.fast_greedy else r.choose(logits[b])
            except Exception as exc:
                self.finish(r, "error", exc)   # released with the finished ones
                continue
            self._accept(r, token, events)
        if self._pending >= self.write_interval:
            self.flush()     # held rows wait: written now, they would be held twice
        return []

    def _capacity(self, reqs: list[Request], longest: int) -> int:
        """Positions of decode buffers for ``reqs`` after ``longest`` cached tokens."""
        remaining = max(r.max_new_tokens - len(r.generated) for r in reqs)
        capacity = longest + 1 + min(remaining, _MAX_HEADROOM)
        if self.max_positions is not None:
            capacity = max(min(capacity, self.max_positions), longest)
        return capacity

    def _group_failed(self, reqs: list[Request], cause: Exception) -> list[list[Request]]:
        """A decode step of ``reqs`` failed before anything of it reached the
        pages: a request alone is the culprit; a batch is split up."""
        if len(reqs) == 1:
            self.finish(reqs[0], "error", cause)   # released with the finished ones
            return []
        self.counters["num_batch_failures"] += 1
        for r in reqs:
            r.isolate = True
        return [[r] for r in reqs]

    def admit(self, events: StepEvents, decoding: bool = False) -> None:
        """Feed up to this step's budget of prompt tokens: the open prompt's
        next chunk, then waiting requests, oldest first, while the batch has
        room and the pool has pages. ``decoding``: whether this step decoded
        running requests (the budget is then a chunk's)."""
        budget = full = self.chunks.tokens(decoding)
        while budget > 0:
            if self.prefilling is None and not self._open(events):
                break
            fill = self.prefilling
            if fill is None:          # the request failed at once: on to the next
                continue
            # never a chunk of n % 128 == 1 rows: its K/V bits would differ (chunking)
            n = chunk_rows(budget, fill.num_tokens - fill.num_done, budget == full)
            if n == 0:
                break
            budget -= n
            if not self._feed(fill, n, events):
                break

    def _open(self, events: StepEvents) -> bool:
        """Start prefilling the first waiting request; False when there is
        none, no room in the batch or too few pages for its prompt."""
        if not self.waiting or len(self.running) + self.waiting[0].width > self.max_batch_size:
            return False
        if self._held:
            # the prompt's pages first, as for any prompt fed before: the
            # new request may share them
            self.flush(ending=True)
        if self._joining is not None:     # the runner feeds the new prompt instead
            self._settle_joining()
        cache, req = self.cache, self.waiting[0]
        seq = None
        try:
            tokens = req.all_tokens()
            seq = cache.add_sequence(tokens[:-1] if self.two_fed and tokens.shape[0] > 1
                                     else tokens, salt=req.salt)
            num_cached = seq.num_cached_tokens
            # keep a page per running request so the next decode step rarely preempts
            if not cache.can_extend(seq, tokens.shape[0] - num_cached,
                                    spare_pages=len(self.running) + len(req.forks)):
                cache.release(seq)
                return False
        except BaseException as exc:
            if seq is not None and not seq.is_released:
                cache.release(seq)
            if not isinstance(exc, Exception):
                raise                     # an interrupt: it stays first in the queue
            self.waiting.popleft()
            self.finish(req, "error", exc)
            return True
        self.waiting.popleft()
        self.prefilling = Prefill(req, seq, tokens, num_cached)
        if not req.admitted:
            req.admitted, req.num_cached = True, num_cached
            events.admitted[req.rid] = num_cached
        self.counters["prefix_hit_tokens"] += num_cached
        self.counters["prefix_query_tokens"] += tokens.shape[0]
        return True

    def _feed(self, fill: Prefill, n: int, events: StepEvents) -> bool:
        """Prefill the next ``n`` tokens of the open prompt; on its last
        chunk the request samples its first token and joins the batch.
        False when the pool has no room for the chunk (the prompt goes back
        to the queue)."""
        cache, req, seq = self.cache, fill.req, fill.seq
        start = fill.num_done
        chunk = fill.tokens[start:start + n]
        last = start + n == fill.num_tokens
        # alone and not forked, the prompt's buffers become its decode buffers;
        # beside running requests, its K/V waits in them to be copied into its
        # row of the next batch (each layer handed back once copied): held
        # once, not in the pages and again in the batch
        held = last and self._exact_pages and not req.forks
        adopt = held and not self.running
        join = held and bool(self.running) and self.runner.positional
        try:
            if not cache.can_extend(seq, n):
                self._close_prefill(requeue=True)
                return False
            past = None
            if start == fill.num_cached and start:    # the first chunk reads the cached past
                gather_plan = cache.plan([seq])
                past = lambda layer, out: cache.gather(  # noqa: E731
                    layer, gather_plan, "BHTD", out=out, host=True)
            logits, _ = self.runner.prefill(chunk, start, past,
                                            self._capacity([req], fill.num_tokens))
            cache.extend(seq, chunk)          # reserved; written after the last chunk
            fill.num_done += n
            if last and not adopt and not join:
                self._write_prompt(fill)
            token = req.choose(logits) if last else None
            if adopt:
                self.forget_batch()           # nothing runs: nothing of it is pending
                self.runner.adopt_prompt()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._close_prefill(requeue=True)
                raise                     # an interrupt: it stays first in the queue
            try:                          # an interrupt in its write still ends it
                self._close_prefill(requeue=False)
            finally:
                self.finish(req, "error", exc)
            return True
        self.counters["num_prefill_chunks"] += 1
        if token is None:
            return True
        self.prefilling = None
        req.seq = seq
        self.running.append(req)
        if adopt:
            self._batch_rids, self._batch, self._held = (req.rid,), [req], {req.rid}
        if join:
            self._joining = fill
        self.counters["num_prefills"] += 1
        self._accept(req, token, events)
        for fork, token, failure in req.start_forks(lambda: cache.fork(seq), logits, events):
            if failure is not None:
                self.finish(fork, "error", failure)
            else:
                self.running.append(fork)
                self._accept(fork, token, events)
        self._retire_finished()
        return True

    def _settle_joining(self) -> None:
        """The joining prompt does not reach a batch's row (it finished, was
        preempted or aborted, or another prompt is fed): its K/V is written
        into the pages, as any prompt's is, and the runner forgets it. A
        failed write loses it: the request, if still running, is recomputed."""
        fill, self._joining = self._joining, None
        if fill is None:
            return
        try:
            if not fill.seq.is_released:
                self._write_prompt(fill)
        except Exception:
            self._lose_joining(fill)
        finally:
            self.runner.forget_prompt()

    def _lose_joining(self, fill: Prefill | None = None) -> None:
        """The joining prompt's K/V is gone (neither in the pages nor in a
        batch): its request goes back to the queue, to be recomputed from
        its tokens; one that finished keeps them."""
        fill = fill or self._joining
        self._joining = None
        self.runner.forget_prompt()
        if fill is None:
            return
        req = fill.req
        if req.seq is not None and not req.seq.is_released:
            self.cache.release(req.seq)   # its unwritten tokens are never indexed
        req.seq = None
        if req in self.running:
            self.running.remove(req)
            if not req.finished:
                self.waiting.appendleft(req)
                self.counters["num_preemptions"] += 1

    def _write_prompt(self, fill: Prefill) -> None:
        """Write the K/V of the chunks fed so far from the runner's prompt
        buffers into the pages, handing each layer's buffers back once
        written; the runner forgets the prompt either way. Nothing is
        written when the runner no longer holds those chunks (a failed
        first chunk, or a failed write before)."""
        start, end = fill.num_written, fill.num_done
        cache, runner, plan = self.cache, self.runner, None
        try:
            if start < end <= runner.prompt_positions:
                plan = cache.plan([fill.seq])   # the chunks' tokens, reserved as they were fed
                for layer in range(cache.num_layers):
                    k, v = runner.prompt_kv(layer, start, end)
                    cache.write(layer, plan, k, v)
                    runner.drop_prompt_layer(layer)
                fill.num_written = end
        except BaseException:
            if plan is not None and not cache.is_written(plan):
                cache.discard(plan)           # nothing of it gets indexed
            raise
        finally:
            runner.forget_prompt()            # its written layers read zero now

    def _close_prefill(self, requeue: bool) -> None:
        """Give up the open prompt: the chunks fed so far are written and
        stay cached, its pages go back and, with ``requeue``, it waits first
        in the queue, to be prefilled again from what the cache still holds."""
        fill = self.prefilling
        if fill is None:
            return
        self.prefilling = None
        try:
            if not fill.seq.is_released:
                try:
                    self._write_prompt(fill)
                except Exception:     # noqa: S110 - those chunks are computed again instead
                    pass
        finally:
            self.runner.forget_prompt()
            if not fill.seq.is_released:
                self.cache.release(fill.seq)
            if requeue:
                self.waiting.appendleft(fill.req)
                self.counters["num_preemptions"] += 1

