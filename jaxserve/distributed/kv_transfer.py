"""Prefill/decode disaggregation: prompts' KV computed on prefill replicas, moved to decode replicas.

``--prefill-replicas N --decode-replicas M``: the front routes every request
to a decode replica (affinity as with ``--data-parallel-size``). Before a new
request enters its engine (``DisaggregatedEngine.generate``), the decode
replica asks the ``prefill`` deployment (N Ray Serve replicas, Ray Serve's
own power-of-two-choices routing) to compute the prompt: the prefill engine
runs it with ``max_tokens=1`` under the ``prophet`` policy (every request
there is in its prefill phase: SRPT by remaining prompt tokens), then reads
the prompt's full pages out of its prefix cache (``ModelExecutor.read_pages``:
``jax.device_get`` to numpy). The arrays travel back as the call's result
through Ray's object store; the decode replica names them in its own prefix
cache (``KVManager.adopt``) and writes them with ``jax.device_put`` and the
swap scatter (``ModelExecutor.write_pages``). The request then enters the
decode engine (``--decode-policy``, MLFQ by default) and finds all but the
last partial page cached: at most ``page_size - 1`` prompt tokens (and at
least one, for the logits) are computed there. API pauses happen on the
decode replica, which keeps the context. A decode replica first looks in its
own cache: it asks for nothing when it holds every full page, and otherwise
only for the pages after those it holds (a conversation's next turn moves
only its new pages).

The page hashes are the engines' own (``scheduler.prefix_cache.chain_hashes``
chained from the cache root of model, dtype, format and seed), so both sides
agree on which pages hold which tokens. A prefill replica that fails or
returns no pages costs only speed: the decode replica computes the prompt
itself (counted in ``jaxserve:remote_prefill_fallbacks``). So does a prefill
deployment with no replica running (killed, restarting, or unable to start):
Ray Serve holds a call to it until a replica runs again, so a call still
pending after ``PREFILL_PROBE_S`` has the deployment's health asked, and again
each ``PREFILL_PROBE_S``; one that does not answer in ``HEALTH_TIMEOUT_S`` ends
the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time

import numpy as np
from prometheus_client import Counter

from jaxserve.async_engine import AsyncEngine
from jaxserve.distributed.routing import HEALTH_TIMEOUT_S
from jaxserve.config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from scheduler.prefix_cache import chain_hashes

log = logging.getLogger("jaxserve.distributed")

PREFILL_POLICY = "prophet"   # all requests of a prefill engine are in their prefill phase: SRPT by prompt tokens


def context_hashes(engine, token_ids: list[int]) -> list[bytes]:
    """The chained hashes of the full pages of ``token_ids`` that a request of this
    prompt can take from the prefix cache (all but the page of its last token)."""
    kv = engine.scheduler.kv
    if kv.cache is None:
        return []
    full = (len(token_ids) - 1) // kv.page_size
    return chain_hashes(kv.cache.root, token_ids[:full * kv.page_size], kv.page_size)


def cached_pages(engine, token_ids: list[int]) -> tuple[int, int]:
    """``(cached, wanted)``: pages of the prompt's cacheable prefix this engine holds, and their number."""
    hashes = context_hashes(engine, token_ids)
    return (len(engine.scheduler.kv.cache.match(hashes)) if hashes else 0), len(hashes)


def export_pages(engine, token_ids: list[int], skip: int = 0) -> tuple[list[bytes], np.ndarray | None]:
    """On the engine thread: the hashes and KV (``[L, 2, n, page_size, Hkv, D]``) of the
    longest cached run of the prompt's full pages, less its first ``skip`` pages (those
    the receiver holds already)."""
    hashes = context_hashes(engine, token_ids)
    pages = engine.scheduler.kv.cache.match(hashes)[skip:] if hashes else []
    if not pages:
        return [], None
    return hashes[skip:skip + len(pages)], engine.executor.read_pages(pages)


def import_pages(engine, hashes: list[bytes], data: np.ndarray) -> int:
    """On the engine thread: cache the pages ``hashes`` name (a run of a context's
    chained page hashes: all of them, or those after the pages this engine holds),
    writing the KV of those not cached yet from ``data``; returns how many were written."""
    adopted = engine.scheduler.kv.adopt(hashes)
    if adopted:
        engine.executor.write_pages([page for _, page in adopted], data[:, :, [i for i, _ in adopted]])
    return len(adopted)


class TransferMetrics:
    """Counters of the moved KV, in a decode replica's registry (``/metrics``)."""

    def __init__(self, registry) -> None:
        self.pages = Counter("jaxserve:kv_transfer_pages", "KV pages moved from prefill replicas.",
                             registry=registry)
        self.bytes = Counter("jaxserve:kv_transfer_bytes", "Bytes of KV moved from prefill replicas.",
                             registry=registry)
        self.seconds = Counter("jaxserve:kv_transfer_seconds", "Seconds spent moving prompts' KV, by stage: "
                               "prefill (the prefill engine's compute), export (device_get), transfer (Ray call "
                               "and object store, minus the prefill side), import (device_put and scatter).",
                               ["stage"], registry=registry)
        self.remote_prefills = Counter("jaxserve:remote_prefills", "Prompts computed on a prefill replica.",
                                       registry=registry)
        self.fallbacks = Counter("jaxserve:remote_prefill_fallbacks", "Prompts computed here because the "
                                 "prefill replica failed or returned no pages.", registry=registry)


PREFILL_PROBE_S = 2.0   # a remote prefill pending this long has the prefill deployment's health asked


class PrefillUnavailable(RuntimeError):
    """The prefill deployment stopped answering while a prompt waited for it."""


class DisaggregatedEngine(AsyncEngine):
    """A decode replica's ``AsyncEngine``: a new request's prompt KV comes from a prefill
    replica first (``prefill``: the deployment handle; ``metrics``: ``TransferMetrics``)."""

    prefill = None
    metrics: TransferMetrics | None = None
    prefill_probe_s = PREFILL_PROBE_S

    async def generate(self, prompt=None, sampling_params=None, request_id=None, *, prompt_token_ids=None,
                       **kwargs):
        cached = None
        scores_prompt = sampling_params is not None and sampling_params.prompt_logprobs is not None
        if prompt_token_ids is not None and self.prefill is not None and not scores_prompt:
            # (a prompt scored for its logprobs is computed here whatever the cache holds: nothing to fetch)
            cached = await self._fetch_prompt_kv(list(prompt_token_ids), kwargs.get("priority", 0))
        async for out in super().generate(prompt, sampling_params, request_id, prompt_token_ids=prompt_token_ids,
                                          **kwargs):
            if cached is not None and out.num_cached_tokens > cached:   # the moved pages were computed for it
                out = dataclasses.replace(out, num_cached_tokens=cached)
            yield out

    async def _fetch_prompt_kv(self, token_ids: list[int], priority: int = 0) -> int | None:
        """Bring the prompt's missing full pages from the prefill replica (computed there in
        the request's ``priority`` class). Returns how many prompt tokens were cached before
        this request on either side (what its usage may call cached: the pages the prefill
        replica computed now were not), None when nothing moved."""
        cached, wanted = await self.call_on_engine(lambda: cached_pages(self.engine, token_ids))
        if wanted == 0 or cached == wanted:
            return None
        start = time.perf_counter()
        try:
            reply = await self._remote_prefill(token_ids, cached, priority)   # only the pages it lacks come back
        except Exception as e:  # noqa: BLE001 - a failed prefill replica costs speed, not the request
            log.warning("remote prefill failed (%s: %s); computing the prompt here", type(e).__name__, e)
            self.metrics.fallbacks.inc()
            return None
        received = time.perf_counter()
        if reply["kv"] is None:
            self.metrics.fallbacks.inc()
            return None
        written = await self.call_on_engine(lambda: import_pages(self.engine, reply["hashes"], reply["kv"]))
        m = self.metrics
        m.remote_prefills.inc()
        m.pages.inc(written)
        m.bytes.inc(reply["kv"].nbytes * written // max(1, len(reply["hashes"])))
        m.seconds.labels("prefill").inc(reply["prefill_s"])
        m.seconds.labels("export").inc(reply["export_s"])
        m.seconds.labels("transfer").inc(max(0.0, received - start - reply["prefill_s"] - reply["export_s"]))
        m.seconds.labels("import").inc(time.perf_counter() - received)
        return max(cached * self.engine.scheduler.page_size, reply["cached_tokens"])


    async def _remote_prefill(self, token_ids: list[int], skip_pages: int, priority: int) -> dict:
        """The prefill deployment's reply (``PrefillReplica.prefill``); ``PrefillUnavailable``
        when, while the call is pending, the deployment does not answer a health check (see
        module doc: Ray Serve would hold the call until a replica runs, maybe forever)."""
        response = self.prefill.prefill.remote(token_ids, skip_pages, priority)
        pending = asyncio.ensure_future(_awaited(response))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=self.prefill_probe_s)
                if done:
                    return pending.result()
                if not await self._prefill_answers():
                    raise PrefillUnavailable("the prefill deployment does not answer its health check")
        finally:
            if not pending.done():
                pending.cancel()
                _cancel(response)

    async def _prefill_answers(self) -> bool:
        response = self.prefill.health.remote()
        try:
            status = await asyncio.wait_for(_awaited(response), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a failed or late check: the deployment is not answering
            _cancel(response)
            return False
        return bool(status.get("alive"))


async def _awaited(response):
    """``await response`` as a coroutine (a Ray Serve ``DeploymentResponse`` is awaitable, not one)."""
    return await response


def _cancel(response) -> None:
    """Drop a Ray Serve call still queued or running (a plain awaitable has nothing to drop)."""
    cancel = getattr(response, "cancel", None)
    if cancel is not None:
        cancel()


class PrefillReplica:
    """A Ray Serve deployment class: an engine that only computes prompts (``prefill``)."""

    def __init__(self, settings: dict) -> None:
        config = EngineConfig.from_cli(argparse.Namespace(**settings), policy=PREFILL_POLICY)
        self.engine = AsyncEngine(config=config)

    async def prefill(self, token_ids: list[int], skip_pages: int = 0, priority: int = 0) -> dict:
        """Compute ``token_ids``' KV (in priority class ``priority``); ``{"hashes", "kv" (numpy
        or None), "prefill_s", "export_s", "cached_tokens"}`` for its full pages after the
        first ``skip_pages`` (the caller holds those); ``cached_tokens``: prompt tokens this
        replica's cache already held."""
        start = time.perf_counter()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for out in self.engine.generate(prompt_token_ids=token_ids, sampling_params=params,
                                              parse_tool_calls=False, parse_reasoning=False, priority=priority):
            pass
        computed = time.perf_counter()
        hashes, kv = await self.engine.call_on_engine(lambda: export_pages(self.engine.engine, token_ids,
                                                                            skip_pages))
        return {"hashes": hashes, "kv": kv, "prefill_s": computed - start, "export_s": time.perf_counter() - computed,
                "cached_tokens": out.num_cached_tokens}   # (of the prompt: from this replica's own cache)

    async def health(self) -> dict:
        return {"alive": self.engine.is_alive}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
