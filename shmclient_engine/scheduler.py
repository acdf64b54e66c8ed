"""Continuous batching in the manner of vLLM v1's scheduler: who runs in the next step.

Engine layer, below the core: imports ``shmclient_engine.model`` (for ``ScheduledChunk``),
``shmclient_engine.request``, ``shmclient.messages`` and ``shmclient.errors`` only; never torch
directly, the core, or a shmclient client module. It owns the waiting and running queues,
the per-step token budget with chunked prefill, the KV-block accounting and preemption by
recompute, and the stop rules. It never runs a model: it hands out ``ScheduledChunk``
lists and takes the sampled tokens back in ``update``. A request releases its model state
through the ``on_free`` callback whenever its blocks are released (finish, abort,
preemption).

Order is first come, first served (``priority`` is not used). Stop rules, checked after
each sampled token, first match wins: EOS (unless ``ignore_eos``) → STOP with
``stop_reason`` None; a ``stop_token_ids`` member → STOP with ``stop_reason`` = that
token; ``max_tokens`` outputs, or ``max_model_len`` tokens in total → LENGTH.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Callable

from shmclient.errors import InvalidRequestError
from shmclient.messages import FinishReason

from .model import ScheduledChunk
from .request import Request, RequestStatus


class PauseState(enum.IntEnum):
    """What a paused scheduler still schedules (vLLM's ``PauseState``).

    ``UNPAUSED``: everything. ``PAUSED_NEW``: the requests that arrived before the pause
    (running, queued or preempted) run to their end; those added since stay queued until
    resumed. ``PAUSED_ALL``: nothing; every request keeps its state (tokens so far, KV
    blocks) until resumed.

    vLLM's PAUSED_NEW admits no waiting request at all, so whether a request added just
    before a pause runs depends on whether a step happened in between; here the order of
    the request stream decides: what came before the pause is in flight.
    """

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


class Scheduler:
    """FCFS continuous batching with chunked prefill and recompute preemption.

    Nothing here blocks. ``add_request`` raises ``InvalidRequestError`` (and changes
    nothing) for a duplicate live id or a prompt that can never fit.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int,
        on_free: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        if max_model_len > num_gpu_blocks * block_size:
            # A lone request could then need more blocks than exist and never finish.
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the KV cache "
                f"({num_gpu_blocks} blocks x {block_size} tokens)")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.on_free = on_free
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_free_blocks = num_gpu_blocks
        #: Total preemptions so far (tests and stats read it).
        self.num_preemptions = 0
        #: Changed through ``set_pause_state`` (the core's pause_scheduler / resume).
        self.pause_state = PauseState.UNPAUSED
        self._next_seq = 0
        #: Requests with an ``arrival_seq`` below this arrived before the pause.
        self._pause_seq = 0

    # ---------------------------------------------------------------- queue changes

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already live")
        if req.num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {req.num_prompt_tokens} tokens is longer than "
                f"max_model_len={self.max_model_len}")
        if self._blocks_for(req.num_prompt_tokens) > self.num_gpu_blocks:
            raise InvalidRequestError(
                f"prompt of {req.num_prompt_tokens} tokens can never fit in the KV cache "
                f"({self.num_gpu_blocks} blocks of {self.block_size} tokens)")
        req.status = RequestStatus.WAITING
        req.arrival_seq = self._next_seq
        self._next_seq += 1
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def set_pause_state(self, state: PauseState) -> None:
        """Pause (see ``PauseState``) or resume. A pause that follows another keeps the
        first one's boundary between in-flight and new requests."""
        if self.pause_state is PauseState.UNPAUSED and state is not PauseState.UNPAUSED:
            self._pause_seq = self._next_seq
        self.pause_state = PauseState(state)

    def _admissible(self, req: Request) -> bool:
        if self.pause_state is PauseState.UNPAUSED:
            return True
        return self.pause_state is PauseState.PAUSED_NEW and req.arrival_seq < self._pause_seq

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """Finish live requests (abort); unknown or finished ids are ignored.

        The waiting ones leave the queue together, in one pass after the loop, and the rest
        keep their order (as vLLM does): removing each from the deque on its own scans it
        once per id, so aborting k of n queued requests would cost O(n*k) and stall every
        other request meanwhile. The running list is at most ``max_num_seqs`` long.
        """
        done = []
        any_waiting = False
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                any_waiting = True
            self._finish(req, reason)
            done.append(req)
        if any_waiting:
            # In place: the deque stays the same object for whoever holds it.
            kept = [r for r in self.waiting if r.status is not RequestStatus.FINISHED]
            self.waiting.clear()
            self.waiting.extend(kept)
        return done

    def preempt_all(self) -> None:
        """Move every running request back to waiting (recompute later), oldest first."""
        while self.running:
            self._preempt(self.running.pop())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether ``schedule()`` may hand out work under the pause state."""
        if self.pause_state is PauseState.UNPAUSED:
            return bool(self.requests)
        if self.pause_state is PauseState.PAUSED_ALL:
            return False
        return bool(self.running) or bool(self.waiting) and self._admissible(self.waiting[0])

    # ---------------------------------------------------------------- one step

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's chunks: running requests first, then waiting ones (FCFS).

        A running request that needs a block when none is free preempts the most
        recently admitted running request (possibly itself). No waiting request is
        admitted in a step that preempted. Under ``PAUSED_NEW`` only requests that
        arrived before the pause are admitted; under ``PAUSED_ALL`` nothing is scheduled.
        """
        if self.pause_state is PauseState.PAUSED_ALL:
            return []
        budget = self.max_num_batched_tokens
        batch: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the last running request
            batch.append(self._chunk(req, n))
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if not self._admissible(req):
                    break  # the queue is in arrival order: the rest came later still
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self._allocate(req, req.num_computed_tokens + n):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                batch.append(self._chunk(req, n))
                budget -= n
        return batch

    def update(self, batch: list[ScheduledChunk], sampled: list[int | None]) -> list[Request]:
        """Apply one step's results; returns the requests that produced output, in order.

        A request in the result either got one new token (its last output token) or, for a
        pooling request, finished its prompt; finished ones have ``finish_reason`` set.
        """
        changed = []
        for chunk, token in zip(batch, sampled):
            req = self.requests[chunk.request_id]
            req.num_computed_tokens += chunk.num_tokens
            if chunk.pool_done:
                self._remove_running(req)
                self._finish(req, FinishReason.STOP)
                changed.append(req)
            elif token is not None:
                req.output_token_ids.append(token)
                reason = self._check_stop(req, token)
                if reason is not None:
                    self._remove_running(req)
                    self._finish(req, reason)
                changed.append(req)
        return changed

    # ---------------------------------------------------------------- introspection

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_free_blocks": self.num_free_blocks,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_preemptions": self.num_preemptions,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if the block accounting or the queues are inconsistent."""
        live = list(self.waiting) + self.running
        assert len(live) == len(self.requests), (live, self.requests)
        assert {r.request_id for r in live} == set(self.requests)
        held = sum(r.num_blocks for r in live)
        assert held + self.num_free_blocks == self.num_gpu_blocks, (held, self.num_free_blocks)
        assert all(r.num_blocks == 0 and r.num_computed_tokens == 0 for r in self.waiting)
        assert len(self.running) <= self.max_num_seqs

    # ---------------------------------------------------------------- internals

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _allocate(self, req: Request, num_tokens: int) -> bool:
        extra = self._blocks_for(num_tokens) - req.num_blocks
        if extra <= 0:
            return True
        if extra > self.num_free_blocks:
            return False
        self.num_free_blocks -= extra
        req.num_blocks += extra
        return True

    def _release(self, req: Request) -> None:
        self.num_free_blocks += req.num_blocks
        req.num_blocks = 0
        req.num_computed_tokens = 0
        self.on_free(req.request_id)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def _remove_running(self, req: Request) -> None:
        self.running.remove(req)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + n
        ids, embeds = req.inputs(start, end)
        last = end == req.num_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=ids,
            embeds=embeds,
            start_pos=start,
            sample=last and req.pooling_params is None,
            sampling_params=req.sampling_params,
            generator=req.generator,
            pooling_params=req.pooling_params,
            pool_done=last and req.pooling_params is not None,
        )

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling_params
        if token == req.eos_token_id and not sp.ignore_eos:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
