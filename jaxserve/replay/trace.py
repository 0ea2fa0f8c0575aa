"""Workload traces: the InferCept/MARS JSON (token and text form) and JSONL.

A trace is a list of ``TraceEntry`` — one recorded request as token counts:
the prompt length, then segments "generate ``num_tokens`` tokens, then call an
API of ``api_type`` that takes ``api_duration_s`` seconds and appends
``num_returned_tokens`` tokens". ``TraceEntry.to_request`` turns one into a
``scheduler.Request`` with an arrival time; the same entry can be sampled many
times into a workload (``jaxserve.replay.workload``).

Formats (DESIGN section 9, ``docs/replay.md``):

* InferCept/MARS JSON: ``{"<id>": [segment, ...]}``. Token form segments have
  ``prompt_tokens``, ``completion_tokens`` and, when they end in an API call,
  ``api_time`` and ``api_token_length``; text form segments have ``prompt``,
  ``completion``, ``api_token`` (strings) and ``api_time``. Only segment 0's
  prompt is read (the context grows by itself afterwards).
* Mooncake JSONL (``timestamp``, ``input_length``, ``output_length``,
  ``hash_ids``; ``jaxserve.replay.mooncake``), recognised by its first line.
* JSONL: one object per line with ``id`` and ``segments`` (segments as above,
  each may add ``api_type``), optionally ``arrival_time`` (seconds),
  ``api_type`` (the default for its calls), ``predictions`` (copied into
  ``Request.predictions``) and ``priority`` (its class, ``Request.priority``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from jaxserve.replay.page_keys import MOONCAKE_BLOCK_TOKENS
from scheduler import Request, Segment

Tokenizer = Callable[[str], Sequence[int]]

MAX_TOKENS_CAP = 2048            # the original driver's max_tokens cap
MAX_API_TIME_S = 1e9             # an API call's longest duration a trace may give (~32 years)
CHARS_PER_TOKEN = 4              # text form without a tokenizer
DEFAULT_TRACE = "merged_exp_uniform.json"
DATA_DIR = Path(__file__).resolve().parent.parent / "data"   # jaxserve/data
BUNDLED_TRACES = ("merged_exp_uniform.json", "diverse_oneapi_merged_exp_uniform.json")

_TOKEN_KEYS = {"prompt_tokens", "completion_tokens", "api_time", "api_token_length"}
_TEXT_KEYS = {"prompt", "completion", "api_token", "api_time"}
_SEGMENT_EXTRA_KEYS = {"api_type"}
_JSONL_KEYS = {"id", "segments", "arrival_time", "api_type", "predictions", "priority"}

# Text-form API calls are recognised by what the call returns (data README).
_TTS_RETURN = "Convert this to text to speech"
_IMAGE_RETURN = "Generate an image about this"
VE_PROMPT_TOKENS = 1973
MATH_MAX_API_S = 1e-3


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One recorded request, in tokens and seconds.

    ``segments`` follow ``scheduler.Segment``: the last one may also end in an
    API call (the request then ends when that call returns).
    """

    request_id: str
    prompt_len: int
    segments: tuple[Segment, ...]
    arrival_time: float | None = None
    kind: str = "unknown"                     # workload class, e.g. "math", "chat"
    predictions: dict = field(default_factory=dict)
    block_ids: tuple[int, ...] | None = None  # Mooncake: ids of the prompt's 512-token blocks
    priority: int = 0                         # its priority class (``Request.priority``)

    @property
    def num_api_calls(self) -> int:
        return sum(1 for s in self.segments if s.has_api_call)

    @property
    def output_len(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def max_tokens(self) -> int:
        """``min(2048, Σ completion + Σ api_return)`` as the original driver set it."""
        return min(MAX_TOKENS_CAP, self.output_len + sum(s.num_returned_tokens for s in self.segments))

    def to_request(self, request_id: str, arrival_time: float, priority: int | None = None) -> Request:
        """A fresh ``scheduler.Request`` for this entry (EOS ignored, as in replay), in class
        ``priority`` (None: the entry's)."""
        segments = [Segment(s.num_tokens, s.api_type, s.api_duration_s, s.num_returned_tokens)
                    for s in self.segments]
        return Request(request_id, arrival_time=arrival_time, prompt_len=self.prompt_len,
                       max_tokens=self.max_tokens, segments=segments, ignore_eos=True,
                       predictions=dict(self.predictions), priority=self.priority if priority is None else priority)


class TraceError(ValueError):
    """A malformed trace; the message names the file, request id and field."""


# ---------------------------------------------------------------- loading
def bundled_trace_path(name: str = DEFAULT_TRACE) -> Path:
    """Path of a trace shipped in ``jaxserve/data`` (see its NOTICE)."""
    if name not in BUNDLED_TRACES:
        raise ValueError(f"no bundled trace {name!r}; bundled: {', '.join(BUNDLED_TRACES)}")
    return DATA_DIR / name


def resolve_trace_path(path: str | Path | None) -> Path:
    """``None`` -> the bundled multi-API trace; a bare bundled name -> its bundled copy."""
    if path is None:
        return bundled_trace_path()
    p = Path(path)
    if not p.exists() and str(path) in BUNDLED_TRACES:
        return bundled_trace_path(str(path))
    if not p.is_file():
        raise FileNotFoundError(f"trace {path} does not exist")
    return p


def load_trace(path: str | Path | None = None, tokenizer: Tokenizer | None = None) -> list[TraceEntry]:
    """Read a trace file (format chosen by content: a JSON object, or JSONL).

    ``tokenizer`` counts the tokens of text-form segments; without one a text
    is ``ceil(len(text) / 4)`` tokens. Raises ``TraceError`` (a ``ValueError``)
    naming the request and field for malformed input.
    """
    p = resolve_trace_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"trace {p}: not UTF-8 text (byte {e.start})") from None
    stripped = text.lstrip()
    if not stripped:
        raise TraceError(f"trace {p}: file is empty")
    if stripped.startswith("{") and looks_like_mooncake(stripped.split("\n", 1)[0]):
        return parse_mooncake(text, source=str(p))
    if p.suffix == ".jsonl" or (stripped.startswith("{") and _looks_like_jsonl(stripped)):
        return parse_jsonl(text, tokenizer, source=str(p))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"trace {p}: not valid JSON ({e})") from None
    return parse_infercept(data, tokenizer, source=str(p))


MOONCAKE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids"}


def looks_like_mooncake(first_line: str) -> bool:
    """True when a JSONL file's first line is a Mooncake record."""
    try:
        obj = json.loads(first_line)
    except json.JSONDecodeError:
        return False
    # (any of its fields and no ``segments``: a Mooncake line missing one is named as such)
    return isinstance(obj, dict) and "segments" not in obj and bool(MOONCAKE_KEYS & set(obj))


def json_objects(text: str, source: str) -> Iterator[tuple[int, str, dict]]:
    """``(line number, "trace SOURCE line N", object)`` for each non-blank line of a
    JSONL text; ``TraceError`` naming the file and line for one that is not a JSON object."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"trace {source} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        yield lineno, where, obj


def parse_mooncake(text: str, source: str = "<trace>") -> list[TraceEntry]:
    """Mooncake JSONL -> entries (ids ``mc-<line>``), in file order. Raises
    ``TraceError`` naming the file and line for any malformed record."""
    entries = []
    for lineno, where, obj in json_objects(text, source):
        missing = MOONCAKE_KEYS - set(obj)
        if missing:
            raise TraceError(f"{where}: missing field(s) {sorted(missing)}")
        unknown = set(obj) - MOONCAKE_KEYS
        if unknown:
            raise TraceError(f"{where}: unknown field(s) {sorted(unknown)}; expected {sorted(MOONCAKE_KEYS)}")
        ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"{where}: field 'timestamp' must be a non-negative number of ms, got {ts!r}")
        for key, v in (("input_length", n_in), ("output_length", n_out)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise TraceError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
        blocks = -(-n_in // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != blocks:
            raise TraceError(f"{where}: 'hash_ids' has {len(ids)} ids; input_length {n_in} needs {blocks} "
                             f"(one per {MOONCAKE_BLOCK_TOKENS}-token block)")
        entries.append(TraceEntry(f"mc-{lineno}", n_in, (Segment(n_out),), ts / 1000.0, "mooncake",
                                  block_ids=tuple(ids)))
    if not entries:
        raise TraceError(f"trace {source}: no requests")
    return entries


def _looks_like_jsonl(text: str) -> bool:
    first = text.split("\n", 1)[0].strip()
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "segments" in obj


def parse_infercept(data: object, tokenizer: Tokenizer | None = None,
                    source: str = "<trace>") -> list[TraceEntry]:
    """``{"<id>": [segment, ...]}`` -> entries, in file order."""
    if not isinstance(data, dict) or not data:
        raise TraceError(f"trace {source}: expected a non-empty JSON object of request id -> segments")
    return [_parse_entry(str(rid), segs, tokenizer, source) for rid, segs in data.items()]


def parse_jsonl(text: str, tokenizer: Tokenizer | None = None, source: str = "<trace>") -> list[TraceEntry]:
    """One JSON object per line: ``id``, ``segments`` and optional ``arrival_time``,
    ``api_type``, ``predictions``, ``priority``. Blank lines are skipped; ids must be unique."""
    entries: list[TraceEntry] = []
    seen: set[str] = set()
    for lineno, where, obj in json_objects(text, source):
        if "id" not in obj:
            raise TraceError(f"{where}: missing field 'id'")
        rid = str(obj["id"])
        unknown = set(obj) - _JSONL_KEYS
        if unknown:
            raise TraceError(f"{where}: request {rid!r}: unknown field(s) {sorted(unknown)}; "
                             f"expected {sorted(_JSONL_KEYS)}")
        if rid in seen:
            raise TraceError(f"{where}: request {rid!r}: duplicate id")
        seen.add(rid)
        if "segments" not in obj:
            raise TraceError(f"{where}: request {rid!r}: missing field 'segments'")
        arrival = obj.get("arrival_time")
        if arrival is not None and not (_is_number(arrival) and arrival >= 0 and math.isfinite(arrival)):
            raise TraceError(f"{where}: request {rid!r}: field 'arrival_time' must be a "
                             f"non-negative number, got {arrival!r}")
        api_type = obj.get("api_type")
        if api_type is not None and not isinstance(api_type, str):
            raise TraceError(f"{where}: request {rid!r}: field 'api_type' must be a string")
        predictions = obj.get("predictions", {})
        if not isinstance(predictions, dict):
            raise TraceError(f"{where}: request {rid!r}: field 'predictions' must be an object")
        for key, wanted in _PREDICTION_TYPES.items():
            if key in predictions and not wanted[0](predictions[key]):
                raise TraceError(f"{where}: request {rid!r}: field 'predictions.{key}' must be {wanted[1]}, "
                                 f"got {predictions[key]!r}")
        priority = obj.get("priority", 0)
        if not _is_int(priority):
            raise TraceError(f"{where}: request {rid!r}: field 'priority' must be an integer, got {priority!r}")
        entries.append(_parse_entry(rid, obj["segments"], tokenizer, f"{source} line {lineno}",
                                    arrival_time=None if arrival is None else float(arrival),
                                    default_api_type=api_type, predictions=predictions, priority=priority))
    if not entries:
        raise TraceError(f"trace {source}: no requests")
    return entries


# The predictions the scheduler's predictors read (``scheduler/predictors.py``): what each must be.
_PREDICTION_TYPES = {
    "output_len": (lambda x: _is_number(x) and 0 <= x < math.inf, "a finite number >= 0 (tokens)"),
    "api_duration_s": (lambda x: _is_number(x) and 0 <= x < math.inf, "a finite number >= 0 (seconds)"),
    "api_type": (lambda x: isinstance(x, str), "a string"),
    "class": (lambda x: isinstance(x, str), "a string"),
}


# ---------------------------------------------------------------- one entry
def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool))


def _count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer(text))
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _parse_entry(rid: str, segs: object, tokenizer: Tokenizer | None, source: str, *,
                 arrival_time: float | None = None, default_api_type: str | None = None,
                 predictions: dict | None = None, priority: int = 0) -> TraceEntry:
    where = f"trace {source}: request {rid!r}"
    if not isinstance(segs, list) or not segs:
        raise TraceError(f"{where}: field 'segments' must be a non-empty list")
    for i, s in enumerate(segs):
        if not isinstance(s, dict):
            raise TraceError(f"{where} segment {i}: expected an object, got {type(s).__name__}")
    text_form = "prompt" in segs[0] or "completion" in segs[0]
    keys = _TEXT_KEYS if text_form else _TOKEN_KEYS
    raw: list[tuple[int, float | None, int, str | None]] = []  # (completion, api_time, returned, api_text)
    prompt_len = 0
    for i, s in enumerate(segs):
        w = f"{where} segment {i}"
        unknown = set(s) - keys - _SEGMENT_EXTRA_KEYS
        if unknown:
            form = "text" if text_form else "token"
            raise TraceError(f"{w}: unknown field(s) {sorted(unknown)} for the {form} form; "
                             f"expected {sorted(keys | _SEGMENT_EXTRA_KEYS)}")
        if text_form:
            if i == 0:
                prompt_len = _count_tokens(_need_str(s, "prompt", w), tokenizer)
            elif "prompt" in s:
                _need_str(s, "prompt", w)
            completion = _count_tokens(_need_str(s, "completion", w), tokenizer)
            has_call = "api_token" in s or "api_time" in s
            api_text = _need_str(s, "api_token", w) if has_call else None
            returned = _count_tokens(api_text, tokenizer) if has_call else 0
        else:
            if i == 0:
                prompt_len = _need_int(s, "prompt_tokens", w)
            elif "prompt_tokens" in s:
                _need_int(s, "prompt_tokens", w)
            completion = _need_int(s, "completion_tokens", w)
            has_call = "api_token_length" in s or "api_time" in s
            api_text = None
            returned = 0
            if has_call:
                if "api_token_length" not in s:
                    raise TraceError(f"{w}: missing field 'api_token_length' (it has 'api_time')")
                returned = s["api_token_length"]
                if returned == -2:      # a cap artefact of the original generator
                    returned = 0
                elif not _is_int(returned) or returned < 0:
                    raise TraceError(f"{w}: field 'api_token_length' must be a non-negative "
                                     f"integer (or -2), got {returned!r}")
        api_time = None
        if has_call:
            if "api_time" not in s:
                raise TraceError(f"{w}: missing field 'api_time' (the segment ends in an API call)")
            api_time = s["api_time"]
            if not _is_number(api_time) or not 0 <= api_time <= MAX_API_TIME_S:
                raise TraceError(f"{w}: field 'api_time' must be a number of seconds from 0 to "
                                 f"{MAX_API_TIME_S:g}, got {api_time!r}")
            api_time = float(api_time)
        elif i < len(segs) - 1:
            raise TraceError(f"{w}: only the last segment may lack an API call "
                             f"(needs 'api_time' and {'api_token' if text_form else 'api_token_length'})")
        if "api_type" in s and not isinstance(s["api_type"], str):
            raise TraceError(f"{w}: field 'api_type' must be a string")
        raw.append((completion, api_time, returned, api_text))
    if prompt_len <= 0:
        raise TraceError(f"{where} segment 0: the prompt must have at least one token")

    kind, call_types = _api_types(text_form, prompt_len, raw)
    segments = []
    for i, (completion, api_time, returned, _) in enumerate(raw):
        explicit = segs[i].get("api_type") or default_api_type
        api_type = (explicit or call_types[i]) if api_time is not None else None
        # A segment generates at least one token: the step that resumes after a call samples one.
        segments.append(Segment(max(1, completion), api_type, api_time, returned))
    if default_api_type:
        kind = default_api_type
    return TraceEntry(rid, prompt_len, tuple(segments), arrival_time, kind, dict(predictions or {}),
                      priority=priority)


def _need_int(s: dict, key: str, where: str) -> int:
    if key not in s:
        raise TraceError(f"{where}: missing field {key!r}")
    v = s[key]
    if not _is_int(v) or v < 0:
        raise TraceError(f"{where}: field {key!r} must be a non-negative integer, got {v!r}")
    return v


def _need_str(s: dict, key: str, where: str) -> str:
    if key not in s:
        raise TraceError(f"{where}: missing field {key!r}")
    v = s[key]
    if not isinstance(v, str):
        raise TraceError(f"{where}: field {key!r} must be a string, got {type(v).__name__}")
    return v


def _api_types(text_form: bool, prompt_len: int,
               raw: list[tuple[int, float | None, int, str | None]]) -> tuple[str, list[str | None]]:
    """The InferCept API classes, derived as the data README describes.

    Token form (one class per request): VE when the prompt is exactly 1,973
    tokens, math when every call takes under 1 ms, else QA. Text form (per
    call): TTS or image when the call returns the converter's canned prompt,
    otherwise a human chat turn. Returns (request kind, type per segment).
    """
    if text_form:
        types = []
        for _, api_time, _, api_text in raw:
            if api_time is None:
                types.append(None)
            elif api_text is not None and api_text.startswith(_TTS_RETURN):
                types.append("tts")
            elif api_text is not None and api_text.startswith(_IMAGE_RETURN):
                types.append("image")
            else:
                types.append("chat")
        present = set(types)
        kind = "tts" if "tts" in present else "image" if "image" in present else "chat"
        return kind, types
    times = [t for _, t, _, _ in raw if t is not None]
    if prompt_len == VE_PROMPT_TOKENS:
        kind = "ve"
    elif times and max(times) < MATH_MAX_API_S:
        kind = "math"
    elif times:
        kind = "qa"
    else:
        kind = "none"
    return kind, [kind if t is not None else None for _, t, _, _ in raw]


def entries_to_jsonl(entries: Iterable[TraceEntry]) -> str:
    """Serialise entries as the JSONL form (token counts; per-segment ``api_type``)."""
    lines = []
    for e in entries:
        segs = []
        for i, s in enumerate(e.segments):
            seg: dict = {"completion_tokens": s.num_tokens}
            if i == 0:
                seg = {"prompt_tokens": e.prompt_len, **seg}
            if s.has_api_call:
                seg.update(api_time=s.api_duration_s, api_token_length=s.num_returned_tokens,
                           api_type=s.api_type)
            segs.append(seg)
        obj: dict = {"id": e.request_id, "segments": segs}
        if e.arrival_time is not None:
            obj["arrival_time"] = e.arrival_time
        if e.predictions:
            obj["predictions"] = e.predictions
        if e.priority:
            obj["priority"] = e.priority
        lines.append(json.dumps(obj))
    return "\n".join(lines) + "\n"


def scale_entries(entries: Iterable[TraceEntry], factor: float = 1.0,
                  api_time_factor: float = 1.0) -> list[TraceEntry]:
    """Entries with every token count multiplied by ``factor`` (rounded; prompts and
    segments keep at least one token) and every API duration by ``api_time_factor``.
    Used to fit a trace into a small model's context window, or to shorten
    wall-clock replays on the real engine."""
    if not factor > 0:
        raise ValueError(f"token scale must be > 0, got {factor}")
    if not api_time_factor >= 0:
        raise ValueError(f"API time scale must be >= 0, got {api_time_factor}")
    entries = list(entries)
    if factor != 1.0 and any(e.block_ids is not None for e in entries):
        raise ValueError("a Mooncake trace's 512-token blocks cannot be token-scaled; drop --token-scale")

    def scale(n: int, least: int) -> int:
        return max(least, round(n * factor))

    def seconds(t: float | None) -> float | None:
        return None if t is None else t * api_time_factor

    return [TraceEntry(e.request_id, scale(e.prompt_len, 1),
                       tuple(Segment(scale(s.num_tokens, 1), s.api_type, seconds(s.api_duration_s),
                                     scale(s.num_returned_tokens, 0)) for s in e.segments),
                       e.arrival_time, e.kind, dict(e.predictions), e.block_ids, e.priority)
            for e in entries]
