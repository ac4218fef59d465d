"""The engine protocol of an endpoint (docs/serving.md): what the broker asks a replica's
engine and what the engine answers, with the rules each request must keep. The broker builds
its requests here (broker/serving/openai_api.py) and its router reads the answers here
(broker/serving/router.py); the provider's daemon hands requests to the engine through here
(provider/replica.py), and the engine decodes and checks them here again before it serves
them (provider/runners/serve.py, engine.py): one rule each, so that a request the broker
passes the engine takes, and a bad one is refused with the same message by either.

On the wire every message is one JSON object: a request is the body of an InferenceRequest
and, with its ``"id"`` added, one line on the engine's socket; an answer is one line per
message, its pieces ``{"id", "text"}`` then one final ``{"id", "done": true, ...}``, carried
back in InferenceChunks. JSON lines rather than protobuf because the engine is the job's own
code in a sandbox, and the daemon and the broker cut and join its answers at newlines."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import ClassVar

MAX_MESSAGES = 1024
MAX_TEXT = 1 << 20              # characters of one prompt, message or input
MAX_INPUTS = 2048               # texts in one embeddings request
MAX_STOP = 4                    # stop strings (OpenAI's limit)
MAX_STOP_CHARS = 256            # characters of one stop string
MAX_TOKENS = 1_048_576          # the largest max_tokens of any request (an endpoint's own
                                # max_tokens may be lower)
DEFAULT_MAX_TOKENS = 16         # a completion's max_tokens when it gives none (OpenAI's) ...
DEFAULT_CHAT_MAX_TOKENS = 256   # ... and a chat's (both at most the endpoint's limit)
MAX_SEED = 2**63
ROLES = ("system", "user", "assistant")
FINISH_REASONS = ("stop", "length")
STATUSES = (400, 413, 429, 500, 502, 503, 504)   # an engine error's status; others are 502
MAX_ERROR = 1000                # characters of an engine's error message
MAX_COUNT = 2**31               # a token count at or over this counts as 0


class BadRequest(ValueError):
    """A request that breaks a rule: ``message`` is one line for the caller, ``param`` the
    field it is about (OpenAI's ``param``), ``code`` OpenAI's code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.request_id: str | None = None     # read_line's: the line's id, if it has one


class Malformed(ValueError):
    """An answer line that is not a JSON object."""


def default_max_tokens(chat: bool, limit: int = MAX_TOKENS) -> int:
    """The max_tokens of a request that gives none: 256 for a chat, 16 for a completion,
    at most ``limit``."""
    return min(limit, DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS)


def _number(value, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"{name} must be a number from {low:g} to {high:g}", name)
    return float(value)


def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string", name)
    if len(value) > MAX_TEXT:
        raise BadRequest(f"{name} is longer than {MAX_TEXT:,} characters", name)
    return value


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    role: str           # one of ROLES
    content: str


@dataclass(frozen=True)
class Complete:
    """A (chat) completion: a ``prompt`` or ``messages``, never both. Made only valid:
    the constructor checks every rule and raises BadRequest."""

    op: ClassVar[str] = "complete"
    prompt: str | None = None
    messages: tuple[Message, ...] = ()
    max_tokens: int = DEFAULT_MAX_TOKENS    # 1 to MAX_TOKENS (and the endpoint's limit)
    temperature: float = 1.0                # 0 to 2; 0 = greedy
    top_p: float = 1.0                      # 0 to 1; 0 and 1 = off
    stop: tuple[str, ...] = ()              # at most MAX_STOP, each 1 to MAX_STOP_CHARS long
    seed: int | None = None                 # 0 to 2**63 - 1

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.messages):
            raise BadRequest("a completion needs a string prompt or a list of messages",
                             "messages" if self.messages else "prompt")
        if self.prompt is not None:
            _text(self.prompt, "prompt")
        if len(self.messages) > MAX_MESSAGES:
            raise BadRequest(f"messages must be a list of 1 to {MAX_MESSAGES} messages",
                             "messages")
        for i, m in enumerate(self.messages):
            if not isinstance(m, Message) or m.role not in ROLES:
                raise BadRequest(f"messages[{i}] needs a role ({', '.join(ROLES)})",
                                 f"messages[{i}].role")
            _text(m.content, f"messages[{i}].content")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer", "max_tokens")
        check_max_tokens(self.max_tokens, MAX_TOKENS)
        object.__setattr__(self, "temperature", _number(self.temperature, "temperature", 0, 2))
        object.__setattr__(self, "top_p", _number(self.top_p, "top_p", 0, 1))
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise BadRequest(f"stop must be a string or a list of up to {MAX_STOP} strings"
                             f" (each 1 to {MAX_STOP_CHARS} characters)", "stop")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, int) or not 0 <= self.seed < MAX_SEED):
            raise BadRequest("seed must be a non-negative integer", "seed")

    @classmethod
    def from_dict(cls, d: dict, limit: int = MAX_TOKENS) -> Complete:
        """The request a JSON object asks (its keys as ``to_dict`` writes them, ``stop`` also
        a single string, ``n`` only 1); max_tokens defaults by ``default_max_tokens`` and
        must be at most ``limit``. Raises BadRequest."""
        messages = d.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
                raise BadRequest(f"messages must be a list of 1 to {MAX_MESSAGES} messages",
                                 "messages")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or m.get("role") not in ROLES:
                    raise BadRequest(f"messages[{i}] needs a role ({', '.join(ROLES)})",
                                     f"messages[{i}].role")
            messages = tuple(Message(m["role"], _text(m.get("content"),
                                                      f"messages[{i}].content"))
                             for i, m in enumerate(messages))
        prompt = d.get("prompt")
        if messages is None and not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
        wanted = d.get("max_tokens")
        if wanted is None:
            wanted = default_max_tokens(messages is not None, limit)
        if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted >= 1:
            check_max_tokens(wanted, limit)
        n = d.get("n", 1)
        if n != 1 or isinstance(n, bool):
            raise BadRequest("n: only one choice per request is supported", "n")
        stop = d.get("stop")
        stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stop, list):
            raise BadRequest(f"stop must be a string or a list of up to {MAX_STOP} strings"
                             f" (each 1 to {MAX_STOP_CHARS} characters)", "stop")
        temperature, top_p = d.get("temperature"), d.get("top_p")
        return cls(prompt=None if messages is not None else prompt, messages=messages or (),
                   max_tokens=wanted, temperature=1.0 if temperature is None else temperature,
                   top_p=1.0 if top_p is None else top_p, stop=tuple(stop),
                   seed=d.get("seed"))

    def to_dict(self) -> dict:
        out: dict = {"op": self.op}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["messages"] = [asdict(m) for m in self.messages]
        out.update(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                   stop=list(self.stop), seed=self.seed)
        return out


def check_max_tokens(wanted: int, limit: int) -> None:
    """Raises BadRequest if ``wanted`` is over ``limit`` (an endpoint's, or MAX_TOKENS)."""
    if wanted > limit:
        raise BadRequest(f"max_tokens {wanted} is over this endpoint's limit of {limit}",
                         "max_tokens", "max_tokens_exceeded")


@dataclass(frozen=True)
class Embed:
    """Embeddings of 1 to MAX_INPUTS texts; the constructor checks them (BadRequest)."""

    op: ClassVar[str] = "embed"
    input: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.input, tuple) or not 1 <= len(self.input) <= MAX_INPUTS \
                or not all(isinstance(t, str) for t in self.input):
            raise BadRequest(f"input must be a string or a list of 1 to {MAX_INPUTS:,} strings"
                             " (token arrays are not supported)", "input")
        for i, t in enumerate(self.input):
            _text(t, f"input[{i}]")

    @classmethod
    def from_dict(cls, d: dict) -> Embed:
        texts = d.get("input")
        return cls(tuple(texts) if isinstance(texts, list) else (texts,)
                   if isinstance(texts, str) else texts)

    def to_dict(self) -> dict:
        return {"op": self.op, "input": list(self.input)}


Request = Complete | Embed
OPS = {"complete": Complete, "embed": Embed}


def encode_request(request: Request) -> bytes:
    """The bytes of an InferenceRequest's body."""
    return json.dumps(request.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()


def _object(data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadRequest("the request is not JSON (or is nested too deeply)") from exc
    if not isinstance(obj, dict):
        raise BadRequest("the request is not a JSON object")
    return obj


def request_of(obj: dict) -> Request:
    """The request a decoded JSON object asks; raises BadRequest."""
    op = obj.get("op")
    if op not in OPS:
        raise BadRequest(f"op {str(op)[:40]!r} is not complete or embed", "op")
    return OPS[op].from_dict(obj)


def decode_request(data: bytes) -> Request:
    """The request an InferenceRequest's body asks; raises BadRequest."""
    return request_of(_object(data))


def request_line(request_id: str, request: Request | None) -> bytes:
    """One line on the engine's socket: the request with its id, or None to cancel it."""
    body = {"op": "cancel"} if request is None else request.to_dict()
    return json.dumps({"id": request_id, **body}).encode() + b"\n"


def read_line(line: bytes) -> tuple[str | None, Request | None]:
    """What one line from the daemon asks: (id, request), (id, None) to cancel; raises
    BadRequest with the id (None if it has none usable) in ``request_id``."""
    obj = _object(line)
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("a request is a JSON object with a string id")
    if obj.get("op") == "cancel":
        return rid, None
    try:
        return rid, request_of(obj)
    except BadRequest as exc:
        exc.request_id = rid
        raise


# -- answers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine's first line, once its model is loaded (the daemon reads it in
    provider/reports.py ``engine_line`` and announces the replica)."""

    engine: str             # what runs it, in words
    task: str               # "generate" or "embed"
    max_concurrency: int
    max_seq_len: int
    model: str

    def line(self) -> bytes:
        return json.dumps({"event": "ready", **asdict(self)}).encode() + b"\n"


@dataclass(frozen=True)
class Piece:
    """Text a completion streams."""

    text: str


@dataclass(frozen=True)
class Final:
    """The last message of an answer: a completion's figures, embeddings, or an error
    (``error`` set, with its HTTP ``status``)."""

    finish_reason: str = "stop"     # one of FINISH_REASONS
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0             # as the engine timed it
    tpot_s: float = 0.0
    embeddings: list[list[float]] | None = None
    error: str | None = None
    status: int = 0                 # with error: one of STATUSES
    # A completion's generated token ids and their activation fingerprints
    # (kinds/fingerprints.py), where the engine records them: what a check of the answer
    # prefills and compares (docs/verification.md). None where it does not.
    token_ids: list[int] | None = None
    fingerprints: list[str] | None = None

    @classmethod
    def failed(cls, message: str, status: int = 400) -> Final:
        return cls(error=message, status=status)

    def to_dict(self) -> dict:
        if self.error is not None:
            return {"error": self.error, "status": self.status, "done": True}
        if self.embeddings is not None:
            return {"embeddings": self.embeddings, "prompt_tokens": self.prompt_tokens,
                    "done": True}
        out = {"done": True, "finish_reason": self.finish_reason,
               "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
               "ttft_s": self.ttft_s, "tpot_s": self.tpot_s}
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
            if self.fingerprints is not None:
                out["fingerprints"] = self.fingerprints
        return out


Answer = Piece | Final


def _answer(answer: Answer) -> dict:
    return {"text": answer.text} if isinstance(answer, Piece) else answer.to_dict()


def encode_answer(answer: Answer) -> bytes:
    """One answer line as the broker reads it (the daemon's own errors)."""
    return json.dumps(_answer(answer)).encode() + b"\n"


def answer_line(request_id: str | None, answer: Answer) -> bytes:
    """One answer line as the engine writes it: with the request's id (null for a line
    whose id was not usable)."""
    return json.dumps({"id": request_id, **_answer(answer)}).encode() + b"\n"


def _count(value) -> int:
    return value if type(value) is int and 0 <= value < MAX_COUNT else 0


def _seconds(value) -> float:
    ok = type(value) in (int, float) and math.isfinite(value) and value >= 0
    return float(value) if ok else 0.0


def _vectors(value) -> list[list[float]] | None:
    if not isinstance(value, list) or not all(
            isinstance(v, list) and all(type(x) in (int, float) and math.isfinite(x) for x in v)
            for v in value):
        return None
    return [[float(x) for x in v] for v in value]


def _committed(obj: dict, output_tokens: int) -> tuple[list[int] | None, list[str] | None]:
    """A final answer's token ids and fingerprints if they are there and fit its
    ``output_tokens`` (one id a token, one fingerprint per kinds.fingerprints.positions);
    (ids, None) where it gives its token ids alone (an engine that records no fingerprints:
    the batch engine's fallback); (None, None) otherwise: an answer that commits to nothing,
    which a check of it judges wrong."""
    from gpumarket.kinds import fingerprints as fp

    ids, prints = obj.get("token_ids"), obj.get("fingerprints")
    if not isinstance(ids, list) or len(ids) != output_tokens:
        return None, None
    if not all(type(t) is int and 0 <= t < MAX_COUNT for t in ids):
        return None, None
    if prints is None and "fingerprints" not in obj:
        return ids, None
    if not isinstance(prints, list) or len(prints) != len(fp.positions(len(ids))) or not all(
            isinstance(x, str) and len(x) <= fp.MAX_TEXT for x in prints):
        return None, None
    return ids, prints


def decode_answer(line: bytes) -> Answer:
    """What one answer line says, every field bounded (the engine is the job's code): a
    Piece (its text, "" if it has none), or the Final if it says ``done``. Raises Malformed
    for a line that is not a JSON object."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise Malformed("not a line of JSON") from exc
    if not isinstance(obj, dict):
        raise Malformed("not a JSON object")
    if not obj.get("done"):
        text = obj.get("text")
        return Piece(text if isinstance(text, str) else "")
    if "error" in obj:
        status = obj.get("status")
        return Final.failed(str(obj.get("error") or "the replica failed")[:MAX_ERROR],
                            status if status in STATUSES else 502)
    reason = obj.get("finish_reason")
    output_tokens = _count(obj.get("output_tokens"))
    ids, prints = _committed(obj, output_tokens)
    return Final(finish_reason=reason if reason in FINISH_REASONS else "stop",
                 prompt_tokens=_count(obj.get("prompt_tokens")),
                 output_tokens=output_tokens,
                 ttft_s=_seconds(obj.get("ttft_s")), tpot_s=_seconds(obj.get("tpot_s")),
                 embeddings=_vectors(obj.get("embeddings")) if "embeddings" in obj else None,
                 token_ids=ids, fingerprints=prints)
