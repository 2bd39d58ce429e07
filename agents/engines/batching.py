"""Continuous batching for the embedded engine: one scheduler thread, one forward pass a step.

Design: every active sequence lives in one shared, *left-padded* KV cache. An attention
mask marks the padding and explicit position ids give each row its own positions, so a
row's logits are those it would get alone (to float rounding). A step feeds every active
row the token it sampled last: one forward pass over the whole batch. Requests that
arrive meanwhile are prefilled together in one forward pass, then their cache rows are
written, left-padded to the batch's length, into spare rows of the batch's buffers; finished
or cancelled rows are dropped (the last rows move into their places) and columns that are
padding in every row are trimmed. Neither copies the batch's other rows, and a plain step
writes its column into spare columns (`agents.engines.kv_layout`). (Per-sequence caches
would have to be stacked, i.e. copied, every step; transformers' `generate` cannot admit a
request while others run.)

Prefix reuse: a request's prompt is prefilled only from where the longest prefix of it that
the engine computed before ends (`agents.engines.prefix_cache`: earlier prompts, and earlier
requests' prompt + completion, so a session's next turn reuses its previous turn whole; at
least the prompt's last token is computed, for its logits). That prefix's KV is copied into
the new rows, left-padded; the rest of each prompt is left-padded after it, so a row reads
[padding, prefix, padding, rest]: the mask hides both paddings and each row gets the logits
it would get alone. A prompt's KV is offered to the cache after its prefill, and a finished
sequence's after its last step. Requests of one version that arrive together first have the
prefix they all share (and the cache lacks) prefilled once, as one row, into the cache: an
evaluation's 100 prompts behind one system prompt, or a new policy version's first
rollouts, would otherwise each compute it (an every-6-steps evaluation of the main job sat
76 s in one such prefill of 100 prompts). Entries are keyed by the adapter slot and version that
computed them (the base model is `(None, 0)`): a newer policy version never reads an older
one's, and entries of versions no request can bind any more are dropped at the next prefill.
Requests that arrive together are prefilled in passes of rows with similar amounts left to
compute (`batch.prefill_passes`): a pass pads each row to its widest (in one pass, a main-job
evaluation computed 1.56 prefill columns a prompt token).

Shared prefixes: rows that join a batch read the first tokens they have in common with the
batch's shared block (an agent's system prompt and tool schemas) from that block, not from
their own cache (`agents.engines.batch`: the block, and how rows join it;
`agents.engines.attention.SharedPrefix`: the decode step's attention over both). Decode steps
only: a prefill computes its rows whole, then they join. Off unless the engine is made with
`share_prefixes=True` (`engine.share_prefixes`; docs/results.md says why).

Adapters: peft's mixed-batch LoRA (`adapter_names=`, one per row, `"__base__"` for the
adapter switched off) lets base and policy rows, and rows of an older and a newer policy
version, share a forward pass. Adapters live in preallocated slots (`agents.engines.lora_slots.
AdapterTable`): a request binds the slot and version current when it is submitted and keeps
them to its end (a count of users per slot). Publishing reads the new adapter on the
caller's thread, copies it into a slot no request uses and flips the policy to it, without
waiting for the scheduler thread: a swap fails no request and never pauses decoding. Only
an adapter of a new shape (the first one, or a new rank) is loaded by peft, between two
steps, which also makes the spare slots of its shape: that one publish is slower, unless
`prepare_adapter` made the slots of its shape beforehand (the trainer does). A forward
pass whose rows all run on the base model switches peft's LoRA layers off and skips peft
(`AdapterTable.lora_model`), so slots cost nothing until a row uses one; so does a pass whose
rows all run on one slot, once that slot's weights are merged (`agents.engines.merged_lora`).
Each row's next token is drawn with its own temperature, top-p and generator
(`agents.engines.sampling`).

All model access (steps, scoring, adapter loads) happens on the scheduler thread; callers
reach it through a queue per request and futures for one-off jobs.

Failures stay as local as the work they break: a request whose sampling or stop check
raises fails alone; a prefill that raises fails only the requests it admits (retried one at
a time, to spare all but the culprit); a decode step that raises fails the rows sharing it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

import torch
from transformers.cache_utils import Cache

from agents.engines.attention import NAME, SharedPrefix
from agents.engines.base import SamplingParams
from agents.engines.batch import (
    MIN_SHARED,
    PREFILL_PASS_TOKENS,
    Batch,
    EventSink,
    Layout,
    Request,
    SharedBlock,
    common_length,
    drop,
    kv_from,
    merge,
    pick_block,
    prefill_passes,
    share,
)
from agents.engines.kv_layout import with_prefixes
from agents.engines.lora_slots import AdapterTable, drop_row_hooks
from agents.engines.prefix_cache import Key, PrefixCache
from agents.engines.sampling import pick_tokens, top_logprobs
from agents.vision import masked_logits

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Scheduler:
    """Owns the model (and its peft wrapper) and runs every request on one thread.

    Args:
        model: the transformers causal LM.
        eos_ids: token ids that end a sequence.
        max_batch: most sequences decoded together.
        threads: torch CPU threads of the scheduler thread (None: torch's default).
        prefix_tokens: most tokens whose KV the prefix cache holds (0: no prefix reuse).
        banned: token ids never sampled (a vision-language model's markup,
            `agents.vision.markup_ids`), None for none.
        merge_lora: whether a batch whose rows all run on one adapter runs on its merged
            weights (`agents.engines.merged_lora`).
        share_prefixes: whether rows read the prompt prefix they have in common from one
            shared block (`agents.engines.batch`); only on a CPU model on `NAME`'s attention.
        prefill_pass_tokens: a prefill pass's own cost in tokens, for splitting the requests
            that arrive together into passes (`batch.prefill_passes`); None: one pass.
    """

    def __init__(
        self,
        model: Any,
        eos_ids: set[int],
        max_batch: int = 32,
        threads: int | None = None,
        prefix_tokens: int = 0,
        banned: torch.Tensor | None = None,
        merge_lora: bool = True,
        share_prefixes: bool = False,
        prefill_pass_tokens: int | None = PREFILL_PASS_TOKENS,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.eos_ids, self.max_batch, self.threads = model, eos_ids, max_batch, threads
        self.banned = banned
        self.prefixes = PrefixCache(prefix_tokens)
        """Scheduler thread only."""
        self.prompt_tokens = 0
        """Prompt tokens of every request prefilled so far."""
        self.cached_tokens = 0
        """Of those, the tokens whose KV the prefix cache gave (never computed again)."""
        self.computed_tokens = 0
        """Columns the prefill passes computed: the other prompt tokens, and the padding
        that left-pads each row of a pass to its widest row."""
        self.pass_tokens = prefill_pass_tokens
        self._cond = threading.Condition()
        self.adapters = AdapterTable(model, self._cond, self.call, merge_lora)
        self._waiting: list[Request] = []
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._batch: Batch | None = None
        self.share_prefixes = (
            share_prefixes
            and model.device.type == "cpu"
            and model.config._attn_implementation == NAME
        )
        self._block: SharedBlock | None = None
        """The block the batch's rows read (when any does)."""
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- callers' side -------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new: int,
        stopped: Callable[[list[int]], bool] | None,
        use_policy: bool,
        events: EventSink,
    ) -> Request:
        """Queues a sequence on the policy (as now) or the base model; its tokens go to
        `events`."""
        generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        with self._cond:
            self._check_open()
            adapter, version = self.adapters.bind() if use_policy else (None, 0)
            request = Request(
                prompt_ids, sampling, max_new, stopped, adapter, version, events, generator
            )
            self._waiting.append(request)
            self._wake()
        return request

    def bind_policy(self) -> tuple[str | None, int]:
        """Binds the policy's slot for a one-off job (scoring); `release` it after."""
        with self._cond:
            return self.adapters.bind()

    def release(self, slot: str | None) -> None:
        if slot is not None:
            with self._cond:
                self.adapters.unbind(slot)

    def _retire(self, requests: list[Request]) -> None:
        """Requests leaving the scheduler (finished, cancelled, failed) free their slots."""
        with self._cond:
            for request in requests:
                if not request.retired:
                    request.retired = True
                    self.adapters.unbind(request.adapter)

    def post(self, job: Callable[[], T]) -> Future[T]:
        """Queues `job` to run on the scheduler thread between two steps."""
        future: Future[T] = Future()
        with self._cond:
            self._check_open()
            self._jobs.append((job, future))
            self._wake()
        return future

    def call(self, job: Callable[[], T]) -> T:
        """Runs `job` on the scheduler thread between two steps; returns its result."""
        return self.post(job).result()

    def close(self) -> None:
        """Stops the thread; requests still running end with an error."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
            self._thread.start()
        self._cond.notify()

    # -- the scheduler thread ------------------------------------------------------------
    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # OpenMP's thread count is per thread
        with torch.inference_mode():
            while (work := self._next_work()) is not None:
                jobs, admitted = work
                self._run_jobs(jobs)
                self.adapters.tidy()
                if admitted:
                    self._admit(admitted)
                    self._run_jobs(self._take_jobs())  # a long prefill delays no job twice
                if self._batch is not None:
                    try:
                        self._step()
                    except Exception as error:  # a broken step fails its rows, not the engine
                        logger.exception("engine step failed")
                        self._fail(self._batch.rows, error)
                        self._batch = None
        self._fail([*self._waiting, *(self._batch.rows if self._batch else [])], None)
        for _, future in self._jobs:
            future.set_exception(RuntimeError("the engine is closed"))

    def _run_jobs(self, jobs: list[tuple[Callable[[], Any], Future[Any]]]) -> None:
        for job, future in jobs:
            _run_job(job, future)

    def _take_jobs(self) -> list[tuple[Callable[[], Any], Future[Any]]]:
        with self._cond:
            jobs, self._jobs = self._jobs, []
        return jobs

    def _next_work(
        self,
    ) -> tuple[list[tuple[Callable[[], Any], Future[Any]]], list[Request]] | None:
        with self._cond:
            while not (self._closed or self._waiting or self._jobs or self._batch):
                self._cond.wait()
            if self._closed:
                return None
            jobs, self._jobs = self._jobs, []
            room = self.max_batch - (len(self._batch.rows) if self._batch else 0)
            admitted = [r for r in self._waiting[:room] if not r.cancelled]
            dropped = [r for r in self._waiting[:room] if r.cancelled]
            del self._waiting[:room]
        self._retire(dropped)
        return jobs, admitted

    def _fail(self, requests: list[Request], error: BaseException | None) -> None:
        self._retire(requests)
        for request in requests:
            request.events.put(error or RuntimeError("the engine is closed"))

    def _admit(self, requests: list[Request]) -> None:
        """Prefills requests into the batch; a prefill that fails fails only its requests.

        Each prompt is prefilled after the longest prefix of it the prefix cache holds (all
        but its last token at most: those logits are needed), in passes (`prefill_passes`);
        the running rows' cache changes only at the merge after a pass. A pass that fails
        before any of its requests got a token is tried again a request at a time: one
        request's prompt (one too long for memory, say) fails no other."""
        try:
            self.prefixes.retain(self._live_keys())
            self._prefill_common(requests)
            held = []
            for request in requests:
                key = (request.adapter, request.version)
                request.cached, pieces = self.prefixes.match(key, request.prompt_ids[:-1])
                held.append(pieces)
        except Exception as error:
            self._admit_failed(requests, error)
            return
        widths = [len(r.prompt_ids) - r.cached for r in requests]
        passes = [list(range(len(requests)))]
        if self.pass_tokens is not None:
            passes = prefill_passes(widths, self.pass_tokens)
        for rows in passes:
            chosen = [requests[row] for row in rows]
            try:
                self._prefill(chosen, [held[row] for row in rows])
            except Exception as error:
                self._admit_failed(chosen, error)

    def _admit_failed(self, requests: list[Request], error: Exception) -> None:
        if len(requests) > 1 and not any(r.ids for r in requests):
            for request in requests:
                self._admit([request])
            return
        logger.error("prefill failed", exc_info=error)
        self._fail(requests, error)

    def _prefill(self, requests: list[Request], pieces: list[list[torch.Tensor]]) -> None:
        """One pass over the requests' prompts after their `cached` tokens, whose KV
        (`pieces`) comes from the prefix cache; the requests join the batch."""
        past = max(r.cached for r in requests)
        width = max(len(r.prompt_ids) - r.cached for r in requests)
        rows = [Layout(r.prompt_ids, r.cached, past, width) for r in requests]
        ids = torch.tensor([row.ids for row in rows])
        mask = torch.tensor([row.mask for row in rows])
        positions = torch.tensor([row.positions for row in rows])
        cache = with_prefixes(pieces, width)
        logprobs, cache = self._forward(requests, ids, mask, positions, cache, None)
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.cached_tokens += sum(r.cached for r in requests)
        self.computed_tokens += ids.numel()
        fresh = Batch(requests, cache, mask, [], [0] * len(requests))
        self._remember(fresh, range(len(requests)))
        done = self._sample(fresh, logprobs)
        self._retire([r for r, d in zip(requests, done, strict=True) if d])
        joining = drop(fresh, done)
        if joining is not None and self.share_prefixes:
            joining = self._share(joining)
        self._batch = merge(self._batch, joining, self.max_batch)

    def _prefill_common(self, requests: list[Request]) -> None:
        """Computes once, into the prefix cache, the prompt prefix that several arriving
        requests of one adapter version share beyond what the cache holds: a new policy
        version's first rollouts of a task, or an evaluation's 100 prompts behind one
        system prompt, would each compute its KV otherwise (128 prompts of 300 tokens,
        282 of them shared, are 38,000 prefill tokens, or 4,000 this way)."""
        if not self.prefixes.max_tokens:
            return
        by_key: dict[Key, list[Request]] = {}
        for request in requests:
            by_key.setdefault((request.adapter, request.version), []).append(request)
        for (adapter, version), group in by_key.items():
            if len(group) < 2:
                continue
            prompts = [r.prompt_ids[:-1] for r in group]
            prefix = prompts[0][: common_length(prompts)]
            held, pieces = self.prefixes.match((adapter, version), prefix)
            if len(prefix) - held < MIN_SHARED:
                continue
            row = Layout(prefix, held, held, len(prefix) - held)
            probe = replace(group[0], prompt_ids=prefix, cached=held, ids=[])
            mask, positions = torch.tensor([row.mask]), torch.tensor([row.positions])
            cache = with_prefixes([pieces], row.width)
            _, cache = self._forward([probe], torch.tensor([row.ids]), mask, positions, cache, None)
            self._remember(Batch([probe], cache, mask, [], [0]), [0])

    def _share(self, fresh: Batch) -> Batch:
        """Joining rows read what they have in common with the batch's shared block (or,
        in a batch where no row reads one, a new block picked from them)."""
        reading = self._batch is not None and any(self._batch.shared)
        block = self._block if reading else pick_block(fresh)
        if block is None:
            return fresh
        fresh = share(fresh, block)
        if any(fresh.shared):
            self._block = block
            if self._batch is not None and not reading:
                # the running rows that start with the new block read it too: one row left
                # holding the prefix in its own cache keeps every row's cache that wide, and
                # each step then pays for the block and the padding both (an evaluation
                # whose first request was admitted alone ran slower with sharing than without)
                self._batch = share(self._batch, block)
        return fresh

    def _step(self) -> None:
        batch = self._batch
        assert batch is not None
        self._retire([r for r in batch.rows if r.cancelled])
        batch = drop(batch, [r.cancelled for r in batch.rows])
        if batch is None:
            self._batch = None
            return
        positions = batch.positions()
        batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        ids = torch.tensor(batch.last)[:, None]
        shared = None
        if any(batch.shared):
            assert self._block is not None
            shared = SharedPrefix(self._block.kv, torch.tensor(batch.shared))
        logprobs, batch.cache = self._forward(
            batch.rows, ids, batch.mask, positions, batch.cache, shared
        )
        done = self._sample(batch, logprobs)
        self._retire([r for r, d in zip(batch.rows, done, strict=True) if d])
        # before the drop, which writes other rows over the finished rows' KV (their callers
        # already have their last token)
        self._remember(batch, [row for row, finished in enumerate(done) if finished])
        self._batch = drop(batch, done)

    def _forward(
        self,
        rows: list[Request],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Cache,
        shared: SharedPrefix | None,
    ) -> tuple[torch.Tensor, Cache]:
        """Raw log-probs (log-softmax at temperature 1) of each row's next token."""
        model, extra = self.adapters.lora_model([r.adapter for r in rows])
        if shared is not None:
            extra = {**extra, "shared_prefix": shared}
        try:
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        except Exception:
            if "adapter_names" in extra:
                drop_row_hooks(model)
            raise
        logits = masked_logits(out.logits[:, -1].float(), self.banned)
        return torch.log_softmax(logits, dim=-1), out.past_key_values

    def _live_keys(self) -> set[Key]:
        """Prefix-cache keys a request can still bind: the base model and the policy now."""
        return {(None, 0), self.adapters.policy}

    def _remember(self, batch: Batch, rows: Iterable[int]) -> None:
        """Offers the KV of these rows' tokens so far (prompt, then each token fed back) to
        the prefix cache; rows of versions no new request binds are not kept. A failure
        here costs later prompts their reuse, never a request."""
        if not self.prefixes.max_tokens:
            return
        live = self._live_keys()
        for row in rows:
            request = batch.rows[row]
            if (request.adapter, request.version) in live:
                try:
                    self._remember_row(batch, row)
                except Exception:
                    logger.exception("keeping a sequence's KV in the prefix cache failed")

    def _remember_row(self, batch: Batch, row: int) -> None:
        request = batch.rows[row]
        tokens, kv = kv_from(batch, row, self._block if batch.shared[row] else None)
        self.prefixes.insert((request.adapter, request.version), tokens, kv)

    def _sample(self, batch: Batch, logprobs: torch.Tensor) -> list[bool]:
        """Picks each row's next token; returns which rows are finished."""
        rows = batch.rows
        picked = pick_tokens(logprobs, [r.sampling for r in rows], [r.generator for r in rows])
        chosen = logprobs[torch.arange(len(rows)), torch.tensor([t or 0 for t in picked])].tolist()
        tops = top_logprobs(logprobs, [r.sampling.top_logprobs for r in rows])
        last, done = [], []
        for request, token, logprob, top in zip(rows, picked, chosen, tops, strict=True):
            try:
                if token is None:
                    raise ValueError("the model's next-token distribution is not finite")
                finished = request.record(token, logprob, top, self.eos_ids)
            except Exception as error:  # one request's sampling or stop check fails it alone
                logger.exception("sampling a request failed")
                request.events.put(error)
                token, finished = 0, True  # its row is dropped: the token is never fed
            last.append(token)
            done.append(finished)
        batch.last = last
        return done


def _run_job(job: Callable[[], Any], future: Future[Any]) -> None:
    try:
        future.set_result(job())
    except Exception as error:
        future.set_exception(error)
