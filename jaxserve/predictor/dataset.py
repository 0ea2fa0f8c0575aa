"""Training examples from a trace's text-form segments, split by request, and
grain batches.

A text-form request (chatbot / TTS / image) is ``[{prompt, completion,
api_token?, api_time?}, ...]`` with ``prompt[i+1] == prompt[i] + completion[i]
+ api_token[i]``. Its context is tokenised piece by piece — ``prompt[0]``
(with the tokenizer's special tokens), then each ``completion`` and
``api_token`` (without) — which is how the engine's context grows, so segment
``i``'s prompt is a prefix of the next one's and one forward over the whole
context gives every segment's last-prompt-token hidden state. The label of
segment ``i`` is ``len(tokenize(completion[i]))``. Token-form requests carry
no text and are skipped (the predictor answers them with a per-class running
mean). Splits are by request id, never by segment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from jaxserve.replay.trace import TraceError, json_objects, resolve_trace_path
from jaxserve.tools import LONE_SURROGATE


class TraceDataError(ValueError):
    """A trace that gives no training data, or malformed text segments; names the file."""


@dataclass(frozen=True)
class TextRequest:
    """One text-form request tokenised: ``token_ids`` is its whole context up to the end of its
    last prompt; segment ``i``'s prompt is ``token_ids[:prompt_ends[i]]`` and it generated
    ``labels[i]`` tokens before its next call (or the end)."""

    request_id: str
    kind: str
    token_ids: tuple[int, ...]
    prompt_ends: tuple[int, ...]
    labels: tuple[int, ...]


def _kind(segments: list[dict]) -> str:
    returns = [s.get("api_token", "") for s in segments if "api_token" in s]
    if any(r.startswith("Convert this to text to speech") for r in returns):
        return "tts"
    if any(r.startswith("Generate an image about this") for r in returns):
        return "image"
    return "chat"


def _jsonl_segments(text: str, path: Path) -> dict:
    """A JSONL trace (``{"id", "segments", ...}`` a line) as request id -> segments; a
    line that is not one is a ``TraceDataError`` naming it (a Mooncake record has no text)."""
    data = {}
    try:
        for _, where, obj in json_objects(text, str(path)):
            if "segments" not in obj or not isinstance(obj.get("id"), str):
                kind = "a Mooncake record (token counts only)" if "hash_ids" in obj \
                    else "not a request with an 'id' and 'segments'"
                raise TraceDataError(f"{where}: {kind}; the length probe needs text-form segments")
            data[obj["id"]] = obj["segments"]
    except TraceError as e:   # (a line that is not a JSON object)
        raise TraceDataError(str(e)) from None
    return data


def load_text_requests(trace: str | Path | None, tokenizer, max_context: int | None = None) -> list[TextRequest]:
    """The text-form requests of ``trace`` (None: the bundled multi-API trace),
    tokenised with the served model's ``tokenizer``; with ``max_context``, only
    requests whose whole context is at most that many tokens (a compute budget).
    Raises ``TraceDataError`` naming the file when it is empty, not a trace, or
    has no text segments."""
    path = resolve_trace_path(trace)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceDataError(f"trace {path} is not readable text: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is None or (isinstance(data, dict) and ("segments" in data or "hash_ids" in data)):
        data = _jsonl_segments(text, path)   # (a JSONL trace; one line of it is a JSON object too)
    if not isinstance(data, dict) or not data:
        raise TraceDataError(f"trace {path} has no requests (expected a JSON object of request id -> segments)")
    out, texts = [], 0
    for rid, segs in data.items():
        if not isinstance(segs, list) or not segs or not isinstance(segs[0], dict) or "prompt" not in segs[0]:
            continue
        where = f"trace {path}, request {rid!r}"
        if not all(isinstance(s, dict) and isinstance(s.get("completion"), str) for s in segs) \
                or not isinstance(segs[0]["prompt"], str):
            raise TraceDataError(f"{where}: text segments need string 'prompt' (segment 0) and 'completion'")
        _check_encodable(where, [segs[0]["prompt"]] + [s["completion"] for s in segs]
                         + [s["api_token"] for s in segs if isinstance(s.get("api_token"), str)])
        ids = list(tokenizer.encode(segs[0]["prompt"], add_special_tokens=True))
        ends, labels = [], []
        for i, s in enumerate(segs):
            completion = tokenizer.encode(s["completion"], add_special_tokens=False)
            ends.append(len(ids))
            labels.append(len(completion))
            if i + 1 < len(segs):   # the last segment's completion and return are not needed as context
                api = s.get("api_token", "")
                if not isinstance(api, str):
                    raise TraceDataError(f"{where} segment {i}: 'api_token' must be a string")
                ids += completion + tokenizer.encode(api, add_special_tokens=False)
        texts += 1
        if max_context is None or len(ids) <= max_context:
            out.append(TextRequest(str(rid), _kind(segs), tuple(int(t) for t in ids), tuple(ends), tuple(labels)))
    if not out:
        raise TraceDataError(f"trace {path} has no text-form segments (prompt/completion strings) to learn from"
                             if not texts else f"trace {path}: none of its {texts} text-form requests fits "
                             f"--max-context {max_context} tokens")
    return out


def _check_encodable(where: str, texts: list[str]) -> None:
    """Each of ``texts`` is valid Unicode (JSON's ``\\ud800`` escape gives a lone surrogate,
    which no tokenizer encodes): a ``TraceDataError`` naming ``where`` otherwise."""
    for text in texts:
        if (lone := LONE_SURROGATE.search(text)) is not None:
            raise TraceDataError(f"{where}: a lone surrogate {lone.group()!r} at character {lone.start()} "
                                 f"(not text a tokenizer can encode)")


# Requests a probe needs: the split by request gives train, validation and test one each at least.
MIN_REQUESTS = 3


def check_enough_requests(requests: list[TextRequest], trace: str | Path | None) -> None:
    """A ``TraceDataError`` when ``requests`` are too few to split (``MIN_REQUESTS``)."""
    if len(requests) < MIN_REQUESTS:
        raise TraceDataError(f"trace {resolve_trace_path(trace)}: {len(requests)} text-form request(s) to use; "
                             f"a probe needs at least {MIN_REQUESTS} (split by request into train, validation "
                             f"and test)")


def split_requests(requests: list[TextRequest], seed: int,
                   fractions: tuple[float, float] = (0.7, 0.15)) -> dict[str, list[TextRequest]]:
    """``{"train", "val", "test"}`` by request id (``fractions`` of requests for train and
    val, the rest test), shuffled with ``seed``. The test split does not depend on
    ``seed``: it is fixed by a hash-free permutation with seed 0, so probes trained with
    different seeds are evaluated on the same held-out requests."""
    ordered = sorted(requests, key=lambda r: r.request_id)
    n = len(ordered)
    perm = np.random.default_rng(0).permutation(n)
    n_test = max(1, int(round(n * (1.0 - sum(fractions))))) if n >= 3 else 0
    test = [ordered[i] for i in perm[:n_test]]
    rest = [ordered[i] for i in perm[n_test:]]
    rest = [rest[i] for i in np.random.default_rng(seed).permutation(len(rest))]
    n_val = max(1, int(round(n * fractions[1]))) if len(rest) >= 2 else 0
    return {"train": rest[n_val:], "val": rest[:n_val], "test": test}


def batches(features: np.ndarray, labels: np.ndarray, batch_size: int, seed: int, epoch: int):
    """One shuffled epoch of ``(features [B, H], bins [B])`` batches through grain
    (the shuffle is seeded by ``seed`` and ``epoch``; the last batch may be short)."""
    index = grain.MapDataset.range(len(labels)).seed(seed * 1000 + epoch).shuffle().batch(batch_size)
    for idx in index:
        idx = np.asarray(idx)
        yield features[idx], labels[idx]
