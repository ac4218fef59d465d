"""The endpoints' OpenAI-compatible API (docs/serving.md), on aiohttp: ``POST
/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events with
``"stream": true``), ``POST /v1/embeddings`` and ``GET /v1/models``. Every call carries an
endpoint's bearer key (``gpumarket endpoint key NAME``); the key opens that endpoint and no
other, and ``model`` must name it. Errors are OpenAI's: a status code and
``{"error": {"message", "type", "param", "code"}}``. A request is made here into the
engine protocol's (kinds/engine_protocol.py), whose rules check it before it reaches a
replica; what only the model knows (the prompt's length in tokens) the engine checks, and
its refusal comes back the same way."""

from __future__ import annotations

import array
import asyncio
import base64
import json
import logging
import secrets
import time

from aiohttp import web

from gpumarket.broker.serving import endpoints, relay
from gpumarket.broker.serving.router import Elsewhere, Endpoint, Refused, Serving
from gpumarket.broker.state import BrokerState
from gpumarket.kinds import engine_protocol as protocol
from gpumarket.kinds.engine_protocol import BadRequest, Complete, Embed, Final, Piece

log = logging.getLogger(__name__)

MAX_BODY = 4 << 20              # bytes of one request
DEFAULT_LIMIT = 4096            # max_tokens allowed when neither endpoint nor replica says
KEY_CACHE_S = 2.0               # a key's lookup is reused this long (revoking clears it)
BODY_TIMEOUT_S = 60.0           # a body must arrive, a streamed piece be taken, within this
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 408: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after


def error_response(exc: ApiError) -> web.Response:
    body = {"error": {"message": exc.message, "type": TYPES.get(exc.status, "server_error"),
                      "param": exc.param, "code": exc.code}}
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    return web.json_response(body, status=exc.status, headers=headers)


def _text(value, name: str):
    """Content parts (a list) as the text of their text parts, joined; anything else as is
    (the protocol checks it)."""
    if isinstance(value, list):
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(value) or not all(isinstance(t, str) for t in parts):
            raise ApiError(400, f"{name}: only text content parts are supported", name)
        value = "".join(parts)
    return value


def _bad(exc: BadRequest, rename: dict | None = None) -> ApiError:
    """The protocol's refusal as OpenAI's 400 (a field under the name the caller used)."""
    message, param = exc.message, exc.param
    if rename and param in rename:
        message, param = message.replace(param, rename[param], 1), rename[param]
    return ApiError(400, message, param, exc.code)


def completion_request(body: dict, chat: bool, limit: int) -> Complete:
    """The engine's request for an OpenAI (chat) completion body, checked by the engine
    protocol's rules; ApiError (400) if it breaks one. OpenAI's spellings are mapped here:
    the role developer (as system), content parts, a prompt list of one,
    max_completion_tokens."""
    fields = {k: body.get(k) for k in ("temperature", "top_p", "n", "stop", "seed")
              if body.get(k) is not None}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not 1 <= len(messages) <= protocol.MAX_MESSAGES:
            raise ApiError(400, f"messages must be a list of 1 to {protocol.MAX_MESSAGES}"
                           " messages", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ApiError(400, f"messages[{i}] needs a role ({', '.join(ROLES)})",
                               f"messages[{i}].role")
        fields["messages"] = [{"role": ROLES[m["role"]],
                               "content": _text(m.get("content") or "",
                                                f"messages[{i}].content")}
                              for i, m in enumerate(messages)]
    else:
        prompt = body.get("prompt")
        fields["prompt"] = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 \
            else prompt
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    if body.get(name) is not None:
        fields["max_tokens"] = body[name]
    try:
        out = Complete.from_dict(fields, limit)
    except BadRequest as exc:
        raise _bad(exc, {"max_tokens": name}) from exc
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(
            options.get("include_usage", False), bool)):
        raise ApiError(400, "stream_options must be an object like {\"include_usage\": true}",
                       "stream_options")
    return out


class OpenAIApi:
    def __init__(self, state: BrokerState, serving: Serving,
                 body_timeout_s: float = BODY_TIMEOUT_S, relay: relay.Relay | None = None
                 ) -> None:
        self.state = state
        self.serving = serving
        self.relay = relay              # brokers sharing a store: serving on any of them
        # A caller that trickles its body, or stops reading a stream, holds a connection
        # (and a replica's slot) no longer than this.
        self.body_timeout_s = body_timeout_s

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.post("/v1/embeddings", self.embeddings),
                web.get("/v1/models", self.models)]

    def app(self) -> web.Application:
        """The API alone, for its own listener (broker config ``api``)."""
        app = web.Application(client_max_size=MAX_BODY)
        app.add_routes([*self.routes(), web.get("/healthz", self._ok)])
        return app

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    # -- the caller and its endpoint ---------------------------------------------------------

    async def _endpoint(self, request: web.Request) -> Endpoint:
        header = request.headers.get("Authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise ApiError(401, "no API key: send Authorization: Bearer KEY (gpumarket"
                           " endpoint key NAME makes one)", code="invalid_api_key")
        secret = secret.strip()
        cache = self.serving.keys
        hit = cache.get(secret)
        if hit is None or time.monotonic() - hit[1] > KEY_CACHE_S:
            if len(cache) > 10_000:
                cache.clear()
            generation = self.serving.keys_generation
            endpoint_id = await self.state.store.read(endpoints.key_endpoint, secret)
            hit = (endpoint_id, time.monotonic())
            if generation == self.serving.keys_generation:   # no revocation meanwhile
                cache[secret] = hit
        ep = self.serving.endpoints.get(hit[0]) if hit[0] else None
        if ep is None and hit[0]:
            # Created since the autoscaler's last pass: bring the router up to date now.
            self.serving.sync(await self.state.store.read(endpoints.live))
            ep = self.serving.endpoints.get(hit[0])
        if ep is None:
            raise ApiError(401, "invalid API key (unknown, revoked, or its endpoint no longer"
                           " serves)", code="invalid_api_key")
        return ep

    async def _raw(self, request: web.Request) -> bytes:
        """The request's body (read once: aiohttp keeps it), within MAX_BODY and
        body_timeout."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"the request is larger than {MAX_BODY:,} bytes") from exc
        except TimeoutError as exc:
            raise ApiError(408, f"the request's body did not arrive within"
                           f" {self.body_timeout_s:.0f} s") from exc

    async def _relayed(self, request: web.Request, ep: Endpoint) -> web.StreamResponse | None:
        """Where this broker holds no ready replica of the endpoint, the answer of a broker
        of the same store that does (broker/serving/relay.py); None: serve it here. A
        request relayed here is never relayed again: served here, or refused at once."""
        if self.relay is None or ep.ready():
            return None
        if request.headers.get(relay.RELAYED):
            return relay.not_here(ep.name)
        return await self.relay.forward(request, ep, await self._raw(request))

    async def _serve(self, request: web.Request, ep: Endpoint, work
                     ) -> tuple[object, Piece | Final] | web.StreamResponse:
        """The router's answer to ``work``: its messages and the first of them; or, where the
        request waited here for a first replica while one became ready on another broker
        (the router's Elsewhere), that broker's answer relayed (broker/serving/relay.py). A
        request relayed here is refused then, for the broker that relayed it to try another;
        one that no other broker took after all waits here again (those brokers no longer
        count)."""
        for _ in range(2):
            answer = self.serving.run(ep, work)
            try:
                return answer, await self._first(answer)
            except Elsewhere:
                if request.headers.get(relay.RELAYED) or self.relay is None:
                    return relay.not_here(ep.name)
                relayed = await self.relay.forward(request, ep, await self._raw(request))
                if relayed is not None:
                    return relayed
        raise ApiError(503, f"endpoint {ep.name} has no ready replica on this broker, and no"
                       " broker said to hold one took the request; retry", retry_after=1)

    async def _body(self, request: web.Request, ep: Endpoint) -> dict:
        raw = await self._raw(request)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, "the request body is not JSON (or is nested too deeply)") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model") != ep.name:
            raise ApiError(404, f"the model {str(body.get('model'))[:100]!r} does not exist or"
                           f" you do not have access to it (this key serves {ep.name!r})",
                           "model", "model_not_found")
        return body

    @staticmethod
    def _limit(ep: Endpoint) -> int:
        """The largest max_tokens a request may ask: the endpoint's own settings (what a
        replica announces is not trusted; its engine refuses what does not fit the model)."""
        return ep.settings["max_tokens"] or ep.settings["max_seq_len"] or DEFAULT_LIMIT

    def _count(self, ep: Endpoint | None, status: int) -> None:
        self.state.metrics.endpoint_requests.labels(endpoint=ep.id if ep else "",
                                                    code=str(status)).inc()

    # -- the calls -----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        try:
            ep = await self._endpoint(request)
        except ApiError as exc:
            return error_response(exc)
        return web.json_response({"object": "list", "data": [
            {"id": ep.name, "object": "model", "created": ep.created_at_ms // 1000,
             "owned_by": ep.client_id}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        ep = None
        try:
            ep = await self._endpoint(request)
            if (relayed := await self._relayed(request, ep)) is not None:
                return relayed
            body = await self._body(request, ep)
            if ep.settings["task"] != "generate":
                raise ApiError(400, f"{ep.name} serves embeddings (POST /v1/embeddings)")
            work = completion_request(body, chat, self._limit(ep))
            served = await self._serve(request, ep, work)
            if isinstance(served, web.StreamResponse):
                return served
            answer, first = served
        except ApiError as exc:
            self._count(ep, exc.status)
            return error_response(exc)
        shape = Shape(ep.name, chat)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, ep, shape, first, answer, usage)
        text, final = [], first
        try:
            while isinstance(final, Piece):
                text.append(final.text)
                final = await answer.__anext__()
        finally:
            await answer.aclose()
        if final.error is not None:
            exc = _engine_error(final)
            self._count(ep, exc.status)
            return error_response(exc)
        self._count(ep, 200)
        return web.json_response(shape.whole("".join(text), final))

    async def _first(self, answer) -> Piece | Final:
        """The answer's first message, or its error as an ApiError (so that a request that
        fails before anything was produced gets an HTTP error, streamed or not)."""
        try:
            first = await answer.__anext__()
        except Elsewhere:
            raise
        except Refused as exc:
            raise ApiError(exc.status, exc.message, retry_after=exc.retry_after) from exc
        if isinstance(first, Final) and first.error is not None:
            await answer.aclose()
            raise _engine_error(first)
        return first

    async def _stream(self, request, ep: Endpoint, shape: "Shape", first: Piece | Final, answer,
                      usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        status = 200
        wait = self.body_timeout_s

        async def event(data: dict | None) -> None:
            # A client that takes nothing of its stream for body_timeout counts as gone.
            async with asyncio.timeout(wait):
                await response.write(b"data: " + json.dumps(data).encode() + b"\n\n"
                                     if data is not None else b"data: [DONE]\n\n")

        try:
            await event(shape.chunk(None, role=True))
            message = first
            while isinstance(message, Piece):
                if message.text:
                    await event(shape.chunk(message.text))
                message = await answer.__anext__()
            if message.error is not None:
                # Tokens were streamed already: the stream ends in an error the client sees.
                exc = _engine_error(message)
                status = exc.status
                await event({"error": {"message": exc.message,
                                       "type": TYPES.get(exc.status, "server_error"),
                                       "param": None, "code": exc.code}})
            else:
                await event(shape.chunk(None, finish=message))
                if usage:
                    await event(shape.usage_chunk(message))
            await event(None)
        except (ConnectionResetError, RuntimeError, TimeoutError):
            status = 499        # the client went away: answer.aclose() cancels the request
            if request.transport is not None:
                request.transport.abort()   # what it did not read is dropped, not flushed
        finally:
            await answer.aclose()
            self._count(ep, status)
        return response

    async def embeddings(self, request: web.Request) -> web.Response:
        ep = None
        try:
            ep = await self._endpoint(request)
            if (relayed := await self._relayed(request, ep)) is not None:
                return relayed
            body = await self._body(request, ep)
            if ep.settings["task"] != "embed":
                raise ApiError(400, f"{ep.name} serves completions, not embeddings")
            try:
                work = Embed.from_dict(body)
            except BadRequest as exc:
                raise _bad(exc) from exc
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise ApiError(400, "encoding_format must be float or base64",
                               "encoding_format")
            served = await self._serve(request, ep, work)
            if isinstance(served, web.StreamResponse):
                return served
            answer, final = served
            await answer.aclose()
            vectors = final.embeddings if isinstance(final, Final) else None
            if vectors is None or len(vectors) != len(work.input):
                raise ApiError(502, "the replica's embeddings are malformed")
        except ApiError as exc:
            self._count(ep, exc.status)
            return error_response(exc)
        self._count(ep, 200)
        tokens = final.prompt_tokens
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(array.array("f", v).tobytes()).decode()
                 if fmt == "base64" else v}
                for i, v in enumerate(vectors)]
        return web.json_response({"object": "list", "data": data, "model": ep.name,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


class Shape:
    """OpenAI's response objects for one request (chat or text completion)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    @staticmethod
    def usage(final: Final) -> dict:
        return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.output_tokens,
                "total_tokens": final.prompt_tokens + final.output_tokens}

    @staticmethod
    def finish(final: Final) -> str:
        return final.finish_reason

    def whole(self, text: str, final: Final) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.finish(final), "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish(final),
                      "logprobs": None}
        return {**self._base(False), "choices": [choice], "usage": self.usage(final)}

    def chunk(self, text: str | None, role: bool = False, finish: Final | None = None) -> dict:
        reason = self.finish(finish) if finish is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason,
                      "logprobs": None}
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, final: Final) -> dict:
        return {**self._base(True), "choices": [], "usage": self.usage(final)}


def _engine_error(final: Final) -> ApiError:
    """An engine's error (its status and message bounded by the protocol's decoder)."""
    return ApiError(final.status, final.error or "the replica failed",
                    retry_after=1 if final.status in (429, 503) else 0)

