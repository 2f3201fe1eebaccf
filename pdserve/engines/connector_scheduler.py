"""The scheduler half of the pdserve vLLM connector (:mod:`pdserve.engines.vllm_connector`):
per request, how much of the prompt the store holds (a load plan), which of its chunks each
step completes (saves), and what the loads came to (``request_finished``). It runs in vLLM's
scheduler process, reaches the store only for lookups, and touches no KV memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_data import (
    PARAMS_KEY,
    ChunkLoad,
    ChunkSave,
    ConnectorSettings,
    PdserveConnectorMetadata,
    RequestLoad,
    log_store_off,
)
from pdserve.engines.connector_keys import (
    KeyScope,
    RequestKeys,
    answers_at_first_token,
    engine_hashes,
    remote_decode,
    request_params,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _LoadPlan:
    start: int  # tokens vLLM already has locally (block aligned)
    end: int  # tokens available after the load (<= len(prompt) - 1)
    keys: list[str]  # stored chunk keys covering [0, len(keys) * chunk_size), maybe past end
    tail_key: str  # "" when the plan ends on a chunk boundary
    block_ids: list[int] = field(default_factory=list)
    tail_tokens: int = 0  # tokens the tail object holds (it may reach past ``end``)
    wait_ms: int = 0  # write mode: the keys may still be landing
    asynchronous: bool = False  # loaded off the step, the request parked meanwhile


@dataclass
class _SaveTracker:
    keys: list[str]
    prompt_len: int
    prompt: list[int]
    tail_key: str
    block_ids: list[int]
    computed: int = 0
    next_chunk: int = 0
    tail_done: bool = False
    tail_rid: str = ""  # the request id the tail key was derived from ("" = handed in)
    #: a request that answers with its first token (max_tokens 1): its saves are written in
    #: the step (ChunkSave.awaited), as a P/D prefill's (one with a tail_key) are
    answers_first: bool = False
    # vLLM's hashes of the prompt's full blocks (request.block_hashes); empty = none
    engine_hashes: list[bytes] = field(default_factory=list)
    root: str = ""  # the chain's root (hex): every save's ChunkSave.root
    tenant: str = ""  # the request's tenant: every save's ChunkSave.tenant


@dataclass
class _Outcome:
    planned: int = 0  # tokens the load plan covered (beyond the local prefix cache)
    plan_start: int = 0
    block_ids: list[int] = field(default_factory=list)
    failed_from: int | None = None  # first token position that failed to load
    chunks: int = 0  # chunks the plan loads (an asynchronous load: saved by their writer)


class ConnectorScheduler:
    """The scheduler-side state and calls (see the module docstring). ``off_reason``: serve
    without the store (a KV layout the engine's workers cannot convert)."""

    def __init__(
        self, settings: ConnectorSettings, block_size: int, io: ChunkIO, off_reason: str = ""
    ) -> None:
        self.settings = settings
        self.fp = settings.fingerprint
        self.block_size = block_size
        self.chunk_size = self.fp.chunk_size
        self.blocks_per_chunk = self.chunk_size // block_size
        self.io = io
        self.off_reason = off_reason
        if off_reason:
            log_store_off(off_reason)
        self._plans: dict[str, _LoadPlan] = {}
        self._trackers: dict[str, _SaveTracker] = {}
        self._outcomes: dict[str, _Outcome] = {}
        self._requests: dict[str, Request] = {}
        #: each live request's chain (or bypass), from its first sight (connector_keys)
        self._keys = RequestKeys(self.fp)
        self._scopes: dict[str, KeyScope] = {}
        #: leading prompt chunks the store held at each waiting request's last lookup: a
        #: request need not save them again (its local prefix-cache hit is not loaded, and
        #: without this every later request on a cached prefix gathered and encoded the whole
        #: prefix again, inside its step, for the master to skip it)
        self._stored: dict[str, int] = {}
        #: asynchronous loads (write mode's, load_async's) allocated, for the next metadata;
        #: requests that have had their one wait
        self._async_plans: dict[str, _LoadPlan] = {}
        self._waited: set[str] = set()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.off_reason or not self.settings.loads:  # kv_producer: saves only
            return 0, False
        scope = self._scope(request.request_id, request)
        if scope.bypass:  # no lookup: vLLM computes the whole prompt
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        limit = len(tokens) - 1  # the last prompt token is always computed
        cs = self.chunk_size
        params = request_params(request)
        keys = scope.chunk_keys(self.fp, tokens)
        # a store that fails answers no hit (ChunkIO): vLLM computes everything
        hit = self.io.lookup(keys)
        self._stored[request.request_id] = hit
        # a stored chunk holding the last token is loaded up to that token (a prefix slice)
        end = min(hit * cs, limit)
        tail_key = str(params.get("load_tail_key", ""))
        tail_end = int(params.get("load_tail_tokens", 0))
        # the tail may hold the last prompt token too (a stock proxy's decode engine gets the
        # prompt alone, not with the first token appended): then it loads up to that token
        use_tail = (
            bool(tail_key)
            and cs * (tail_end // cs) == end
            and end < tail_end <= limit + 1
            and self._tail_in_chain(scope, tokens[:tail_end], tail_key, params)
            and self.io.has(tail_key)
        )
        tail_tokens = tail_end - end if use_tail else 0
        if use_tail:
            end = min(tail_end, limit)
        else:
            tail_key = ""
        awaited = min(int(params.get("await_chunks", 0)), limit // cs)
        wait_ms = int(params.get("chunk_wait_ms", 0))
        if (
            hit < awaited
            and wait_ms > 0
            and num_computed_tokens < awaited * cs
            and request.request_id not in self._waited
        ):
            # write mode: the chunks are still landing; vLLM parks the request meanwhile
            self._plans[request.request_id] = _LoadPlan(
                start=num_computed_tokens,
                end=awaited * cs,
                keys=keys[:awaited],
                tail_key="",
                wait_ms=wait_ms,
                asynchronous=True,
            )
            return awaited * cs - num_computed_tokens, True
        if end <= num_computed_tokens:
            self._plans.pop(request.request_id, None)
            return 0, False
        # load_async: off the step, once per request (a failed one vLLM reschedules loads what
        # is stored before its step, as write mode's)
        deferred = self.settings.load_async and request.request_id not in self._waited
        self._plans[request.request_id] = _LoadPlan(
            start=num_computed_tokens,
            end=end,
            keys=keys[:hit],
            tail_key=tail_key,
            tail_tokens=tail_tokens,
            asynchronous=deferred,
        )
        return end - num_computed_tokens, deferred

    def _tail_in_chain(
        self, scope: KeyScope, prompt: list[int], tail_key: str, params: dict[str, Any]
    ) -> bool:
        """Whether the handed tail belongs to this request's chain. A stock prefill names the
        request id its tail key was derived from (``load_tail_rid``): the tail is loaded only
        when this request's own chain (salt, adapter) derives the same key from it, so a proxy
        that pairs a prefill and a decode of different adapters or salts gets a recompute, not
        the other chain's KV. Without an id (pdserve's own workers: the router pairs the two
        phases of one request, and never with an adapter) the tail is trusted, except for a
        request through an adapter, whose tail must prove its chain."""
        rid = params.get("load_tail_rid")
        if rid is None:
            return not scope.adapter
        return isinstance(rid, str) and scope.tail_key(self.fp, prompt, rid) == tail_key

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        if num_external_tokens <= 0:
            del self._plans[request.request_id]
            return
        # The scheduler may trim a sub-block local hit: re-derive where the load starts.
        plan.start = plan.end - num_external_tokens
        plan.block_ids = list(blocks.get_block_ids()[0])
        if plan.asynchronous:  # parked in WAITING_FOR_REMOTE_KVS: not in this step's new ones
            self._waited.add(request.request_id)
            self._async_plans[request.request_id] = self._plans.pop(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdserveConnectorMetadata:
        meta = PdserveConnectorMetadata()
        if self.off_reason:
            return meta
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
            self._plans.pop(req_id, None)
            self._stored.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._trackers.pop(req_id, None)
        for req_id, plan in self._async_plans.items():
            meta.loads.append(self._load_meta(req_id, plan, plan.block_ids))
            self._outcomes[req_id] = _Outcome(
                planned=plan.end - plan.start,
                plan_start=plan.start,
                block_ids=plan.block_ids,
                chunks=len(plan.keys),
            )
        self._async_plans.clear()

        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.pop(new.req_id, None)
            block_ids = list(new.block_ids[0])
            # chunks the store holds: not saved again (a local prefix-cache hit's included)
            loaded_chunks = self._stored.pop(new.req_id, 0)
            if plan is not None:
                meta.loads.append(self._load_meta(new.req_id, plan, block_ids))
                loaded_chunks = len(plan.keys)
                self._outcomes[new.req_id] = _Outcome(
                    planned=plan.end - plan.start, plan_start=plan.start, block_ids=block_ids
                )
            elif new.req_id in self._outcomes:  # its asynchronous load is over
                done = self._outcomes[new.req_id]
                failed = done.failed_from
                loaded_chunks = done.chunks if failed is None else failed // self.chunk_size
            prompt = list(new.prompt_token_ids or [])
            if not self._track(new.req_id, prompt, block_ids, loaded_chunks, new):
                continue  # a bypass: nothing of it is saved
            self._advance(
                new.req_id,
                new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                meta,
            )

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracker.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracker.block_ids.extend(new_ids[0])
            self._advance(
                req_id,
                cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id],
                meta,
            )
        return meta

    def _load_meta(self, req_id: str, plan: _LoadPlan, block_ids: list[int]) -> RequestLoad:
        cs = self.chunk_size
        chunks = [
            ChunkLoad(key, i * cs, cs, plan.start, min((i + 1) * cs, plan.end))
            for i, key in enumerate(plan.keys)
            if (i + 1) * cs > plan.start
        ]
        if plan.tail_key:
            base = len(plan.keys) * cs
            chunks.append(ChunkLoad(plan.tail_key, base, plan.tail_tokens, plan.start, plan.end))
        return RequestLoad(
            req_id, block_ids, chunks, plan.wait_ms, self._trace(req_id), plan.asynchronous
        )

    def _trace(self, req_id: str) -> dict[str, str]:
        """The request's trace headers (empty unless vLLM traces it)."""
        headers = getattr(self._requests.get(req_id), "trace_headers", None)
        return dict(headers) if headers else {}

    def _scope(self, req_id: str, request: Any) -> KeyScope:
        """The chain of request ``req_id`` (or its bypass), worked out at its first sight
        from ``request`` (vLLM's ``Request``, or a step's ``NewRequestData``) and kept until
        it finishes."""
        scope = self._scopes.get(req_id)
        if scope is None:
            scope = self._scopes[req_id] = self._keys.scope(request)
        return scope

    def _track(
        self,
        req_id: str,
        prompt: list[int],
        block_ids: list[int],
        loaded_chunks: int,
        new: Any = None,
    ) -> bool:
        """Starts tracking the saves of the newly scheduled request ``req_id`` (its chain from
        its vLLM ``Request``, else from the step's ``NewRequestData`` ``new``); False for a
        request that bypasses the store (not tracked)."""
        request = self._requests.get(req_id)
        scope = self._scope(req_id, request if request is not None else new)
        if scope.bypass:
            return False
        tail = str(request_params(request).get("save_tail_key", ""))
        tail_rid = ""
        if not tail and remote_decode(request):  # a stock proxy's prefill: the tail too
            tail, tail_rid = scope.tail_key(self.fp, prompt, req_id), req_id
        self._trackers[req_id] = _SaveTracker(
            keys=scope.chunk_keys(self.fp, prompt),
            prompt_len=len(prompt),
            prompt=prompt,
            tail_key=tail,
            tail_rid=tail_rid,
            block_ids=block_ids,
            next_chunk=loaded_chunks,
            engine_hashes=engine_hashes(request, len(prompt), self.block_size),
            root=scope.root,
            tenant=scope.tenant,
            answers_first=answers_at_first_token(request),
        )
        return True

    def _advance(self, req_id: str, computed: int, meta: PdserveConnectorMetadata) -> None:
        """Emits saves for the prompt chunks (and tail) that ``computed`` tokens complete."""
        tracker = self._trackers[req_id]
        tracker.computed = computed
        if not self.settings.saves:  # kv_consumer: loads only
            return
        saves = len(meta.saves)
        self._advance_saves(tracker, computed, meta)
        trace = self._trace(req_id) if len(meta.saves) > saves else None
        if trace:
            meta.save_traces.append(trace)

    def _advance_saves(
        self, tracker: _SaveTracker, computed: int, meta: PdserveConnectorMetadata
    ) -> None:
        cs, bs, bpc = self.chunk_size, self.block_size, self.blocks_per_chunk
        done = min(computed, tracker.prompt_len) // cs
        engine = tracker.engine_hashes
        for i in range(tracker.next_chunk, done):
            blocks = tracker.block_ids[i * bpc : (i + 1) * bpc]
            parent = tracker.keys[i - 1] if i else ""
            tokens = list(tracker.prompt[i * cs : (i + 1) * cs])
            save = ChunkSave(
                tracker.keys[i],
                i * cs,
                cs,
                blocks,
                0,
                parent,
                tokens,
                root=tracker.root,
                tenant=tracker.tenant,
                # a P/D prefill's decode, or the answer, loads them next: in the step
                awaited=bool(tracker.tail_key) or tracker.answers_first,
            )
            if len(engine) >= (i + 1) * bpc:  # vLLM's own hashes of the chunk's blocks
                save.engine_hashes = engine[i * bpc : (i + 1) * bpc]
                save.engine_parent = engine[i * bpc - 1] if i else b""
                save.engine_block_size = bs
            meta.saves.append(save)
        tracker.next_chunk = max(tracker.next_chunk, done)
        if tracker.tail_key and not tracker.tail_done and computed >= tracker.prompt_len:
            start = len(tracker.keys) * cs
            n = tracker.prompt_len - start
            if n > 0:
                blocks = tracker.block_ids[start // bs : (tracker.prompt_len + bs - 1) // bs]
                ttl = self.settings.tail_ttl_ms
                meta.saves.append(
                    ChunkSave(
                        tracker.tail_key,
                        start,
                        n,
                        blocks,
                        ttl,
                        root=tracker.root,
                        tenant=tracker.tenant,
                        awaited=True,
                    )
                )
            tracker.tail_done = True

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._scope(request.request_id, request)

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        bs = self.block_size
        for outcome in self._outcomes.values():
            first = outcome.plan_start // bs
            last = (outcome.plan_start + outcome.planned + bs - 1) // bs
            for idx in range(first, min(last, len(outcome.block_ids))):
                if outcome.block_ids[idx] in invalid:
                    pos = idx * bs
                    if outcome.failed_from is None or pos < outcome.failed_from:
                        outcome.failed_from = pos
                    break

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        scope = self._scopes.pop(req_id, None)
        tracker = self._trackers.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._stored.pop(req_id, None)
        self._async_plans.pop(req_id, None)
        self._waited.discard(req_id)
        outcome = self._outcomes.pop(req_id, _Outcome())
        failed = 0
        if outcome.failed_from is not None:
            failed = (
                outcome.plan_start + outcome.planned - max(outcome.failed_from, outcome.plan_start)
            )
        ours: dict[str, Any] = {"loaded_tokens": outcome.planned - failed, "failed_tokens": failed}
        if scope is not None and scope.bypass:
            ours["bypassed"] = scope.bypass  # why it was computed without the store
        out: dict[str, Any] = {PARAMS_KEY: ours}
        if tracker is not None and remote_decode(request) and self.settings.saves:
            # what the decode engine's connector needs beyond the stored chunks: the tail
            out["do_remote_prefill"] = True
            if tracker.tail_key and tracker.tail_done:
                ours.update(
                    load_tail_key=tracker.tail_key,
                    load_tail_tokens=tracker.prompt_len,
                )
                if tracker.tail_rid:  # lets the decode engine check the tail is its chain's
                    ours["load_tail_rid"] = tracker.tail_rid
        return False, out
