"""The engines behind an inference endpoint's replica, under one interface (``Engine``): a
batcher that decodes every request in flight step by step, new ones joining between steps
(batching.py; before issue 32, one ``model.generate`` call at a time, still its fallback),
transformers continuous batching (batching.py), vLLM's AsyncLLM (batching.py, untested
here), and a sentence encoder (below). serve.py drives one over the daemon's socket, or in
process as a benchmark.

The figures below were measured before the batcher decoded step by step (its former path
is ``serve --bench MODEL batch-calls``); docs/provider.md ("Engines on a GPU") has the
step-wise batcher's, and bench/serving.py's case 4 the time to first token of requests that
arrive while another decodes.

Measured on this repository's shared CPU host (2 cores, torch 2.13 CPU, transformers 5.23),
the 2-layer Llama of tests/models.py, 16 concurrent greedy requests x 16 new tokens,
max_concurrency 8, median of 5 rounds after a warm-up request, five runs each (/tmp/tiny
made by ``tests.models.tiny_causal_lm``):

    python -m gpumarket.provider.runners.serve --bench /tmp/tiny batch 16 16
    python -m gpumarket.provider.runners.serve --bench /tmp/tiny continuous 16 16

    batch       31-37 ms wall, 256 tokens, 6,900-8,200 tokens/s, TTFT p50 18-22 ms
    continuous  43-48 ms wall, 256 tokens, 5,350-5,900 tokens/s, TTFT p50 23-25 ms

With an 8-layer, 512-wide random Llama the two were level (470-770 ms a round as the
host's load varied, neither ahead by more than 10%). While other test processes loaded the
host, rounds of both stalled for seconds (OpenMP threads oversubscribing 2 cores),
continuous batching more often. The batcher's ``generate`` calls share one thread: each new
calling thread gets its own OpenMP team, and to_thread's pool made rounds 30% slower. So on
CPU "auto" picks the batcher, whose greedy text also equals plain ``generate``'s; on CUDA it
picks continuous batching (requests join and leave between steps instead of waiting for a
batch's slowest row). Continuous batching works on CPU when asked for.

The continuous engine fingerprints each answer as it ends (one prefill on a twin of the
model, fingerprint.Committer; docs/verification.md, Endpoint answers); on this CPU that
halved its figures above (two pairs, load about 1.3: 5,239 and 5,255 tokens/s, TTFT p50 27
and 25 ms, before; 2,766 and 2,123 tokens/s, TTFT p50 42 and 63 ms, after), the prefill
thread's OpenMP team contending with the manager's. Its GPU cost is not measured.

Seeds: the batcher draws each sampled request's tokens from a generator of its own, seeded
with the request's seed: a seeded request repeats whatever else is in flight (up to the
rounding of a batch's arithmetic; in its former path, a seeded request repeated only when
its batch did). vLLM takes each request's seed; transformers continuous batching has one
generator for all requests and ignores it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpumarket.kinds.engine_protocol import Complete, Final, Piece
from gpumarket.provider.runners.base import JobError
from gpumarket.provider.runners.inference import torch_device, torch_dtype, unpack_model

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 8
MAX_SEQ_LEN_CAP = 4096  # the default max_seq_len: the model's, at most this
EMBED_BATCH = 32  # texts per encoder call
GREEDY_TEMPERATURE = 1e-6  # continuous batching samples every request: greedy is this
CPU_DEFAULT = "batch"  # from the measurement above
ENGINES = ("", "auto", "batch", "continuous", "vllm")


class Engine(Protocol):
    description: str  # what runs it, for the ready event and the job log
    task: str  # "generate" or "embed"
    max_concurrency: int
    max_seq_len: int

    def complete(self, request_id: str, request: Complete) -> AsyncIterator[Piece | Final]:
        """An async generator: Pieces, then one Final (figures or an error)."""

    async def embed(self, texts: tuple[str, ...]) -> Final: ...
    def cancel(self, request_id: str) -> None: ...
    async def close(self) -> None: ...


class RequestError(Exception):
    """A request the endpoint cannot serve; the message is for the caller, one line."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def event(self) -> Final:
        return Final.failed(str(self), self.status)


@dataclass(frozen=True)
class Settings:
    task: str  # "generate" or "embed"
    engine: str  # one of ENGINES; "" and "auto" choose by device
    dtype: str  # "", "auto", "float32", "bfloat16", "float16"
    max_seq_len: int  # tokens of prompt + output; 0 = the model's, at most MAX_SEQ_LEN_CAP
    max_concurrency: int  # sequences served at once; 0 = DEFAULT_CONCURRENCY
    trust_remote_code: bool

    @classmethod
    def from_params(cls, p: dict) -> Settings:
        """The endpoint's params, checked; raises JobError."""
        task, engine = p.get("task") or "generate", p.get("engine") or ""
        if task not in ("generate", "embed"):
            raise JobError(f"task {task!r} is not generate or embed")
        if engine not in ENGINES:
            raise JobError(f"engine {engine!r} is not one of auto, batch, continuous, vllm")
        for name in ("max_seq_len", "max_concurrency"):
            value = p.get(name) or 0
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise JobError(f"{name} must be a whole number >= 0")
        return cls(task, engine, p.get("dtype") or "", p.get("max_seq_len") or 0,
                   p.get("max_concurrency") or DEFAULT_CONCURRENCY,
                   bool(p.get("trust_remote_code")))


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float  # 1 = off
    stop: tuple[str, ...]
    seed: int | None


def chat_prompt(tokenizer, messages: tuple) -> str:
    """The text of a chat (checked Messages): the tokenizer's template, else "role: content"
    lines."""
    messages = [{"role": m.role, "content": m.content} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # the template's own checks, e.g. roles must alternate
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RequestError(f"messages: the model's chat template refused them ({reason})")
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def parse_completion(request: Complete, tokenizer, max_seq_len: int
                     ) -> tuple[list[int], Sampling]:
    """The prompt's token ids and the sampling settings of a completion request (checked by
    the protocol, kinds/engine_protocol.py); raises RequestError (400) for what only the
    model knows: a prompt with no tokens, or one too long."""
    max_tokens, temperature = request.max_tokens, request.temperature
    top_p, stop, seed = request.top_p or 1.0, request.stop, request.seed
    if request.messages:
        text = chat_prompt(tokenizer, request.messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(request.prompt)["input_ids"]
    if not ids:
        raise RequestError("the prompt has no tokens")
    if len(ids) + max_tokens > max_seq_len:
        raise RequestError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds this"
                           f" endpoint's max_seq_len {max_seq_len}")
    return ids, Sampling(max_tokens, temperature, top_p if temperature > 0 else 1.0,
                         tuple(stop), seed)


class Stream:
    """One completion in flight. ``advance`` takes all the ids generated so far (in the
    engine's thread or on the loop), decodes them whole, applies EOS, stop strings and
    max_tokens, and queues the new text, then the final figures; every event goes through
    the loop, so any thread may call it."""

    def __init__(self, tokenizer, eos: set[int], request_id: str, prompt_ids: list[int],
                 sampling: Sampling) -> None:
        self.loop, self.tokenizer, self.eos = asyncio.get_running_loop(), tokenizer, eos
        self.request_id, self.prompt_ids, self.sampling = request_id, prompt_ids, sampling
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine_id, self.sent, self.finished, self.cancelled = request_id, "", False, False
        self.arrived, self.first, self.last, self.tokens = time.perf_counter(), 0.0, 0.0, 0
        self.ids: list[int] = []
        # Activation fingerprints, where the engine records them (batching.Rows): those made
        # so far, and the state of the last token, fingerprinted at the end if no multiple
        # of fingerprints.EVERY covered it (None where the engine records none).
        self.prints: list[str] | None = None
        self.last_state, self.k = None, 0
        # Where the engine records none: called with the Final at the end, it fingerprints
        # the answer and delivers it (fingerprint.Committer); None: the Final goes at once.
        self.commit = None

    def _post(self, event: Piece | Final | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def advance(self, ids: list[int]) -> bool:
        """Returns whether this completion is over (finished or cancelled)."""
        if self.finished or self.cancelled:
            return True
        if not ids:
            return False
        self.last = time.perf_counter()
        self.first = self.first or self.last
        finish = None
        cut = next((i for i, t in enumerate(ids) if t in self.eos), None)
        if cut is not None:
            ids, finish = ids[:cut + 1], "stop"
        self.tokens, self.ids = len(ids), ids
        text = self.tokenizer.decode(ids[:cut] if cut is not None else ids,
                                     skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.sampling.stop) if i >= 0]
        if hits:
            text, finish = text[:min(hits)], "stop"
        if finish is None and self.tokens >= self.sampling.max_tokens:
            finish = "length"
        if finish is None:  # hold back half a character and what may begin a stop string
            text = text.rstrip("\ufffd")
            text = text[:len(text) - max((k for s in self.sampling.stop for k in range(1, len(s))
                                          if text.endswith(s[:k])), default=0)]
        if len(text) > len(self.sent):
            self._post(Piece(text[len(self.sent):]))
            self.sent = text
        if finish:
            self.end(finish)
        return finish is not None

    def end(self, finish: str) -> None:
        if not (self.finished or self.cancelled):
            self.finished = True
            n, first = self.tokens, self.first - self.arrived if self.first else 0.0
            # its token ids always: a check prefills them (a greedy answer's are judged by
            # the token gap where the engine records no fingerprints, docs/verification.md)
            committed: dict = {"token_ids": list(self.ids[:n])}
            if self.prints is not None:
                prints = list(self.prints)
                if self.last_state is not None:
                    from gpumarket.provider.runners.fingerprint import encode_state

                    prints.append(encode_state(self.last_state, self.k))
                committed["fingerprints"] = prints
            final = Final(finish_reason=finish, prompt_tokens=len(self.prompt_ids),
                          output_tokens=n, ttft_s=first,
                          tpot_s=(self.last - self.first) / (n - 1) if n > 1 else 0.0,
                          **committed)
            if self.commit is not None and "fingerprints" not in committed:
                self.commit(self, final)
            else:
                self._post(final)

    def deliver(self, final: Final) -> None:
        """The Final of an ended completion, fingerprinted after its end (``commit``)."""
        if not self.cancelled:
            self._post(final)

    def deliver_failure(self, message: str) -> None:
        """An ended completion the engine stopped before it was fingerprinted: a 500."""
        if not self.cancelled:
            self._post(RequestError(message, 500).event())

    def fail(self, message: str, status: int = 500) -> None:
        if not (self.finished or self.cancelled):
            self.finished = True
            self._post(RequestError(message, status).event())

    def cancel(self) -> None:
        self.cancelled = True
        self._post(None)

    async def events(self) -> AsyncIterator[Piece | Final]:
        while (event := await self.queue.get()) is not None:
            yield event
            if isinstance(event, Final):
                return


class Generating:
    """What the completion engines share: each request becomes a Stream; ``_submit`` starts
    it and ``_abort`` frees its slot, each engine its own way."""

    task = "generate"
    description = ""

    def __init__(self, tokenizer, eos, settings: Settings, max_seq_len: int) -> None:
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len
        self.max_concurrency = settings.max_concurrency
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.streams: dict[str, Stream] = {}
        self.serial = 0

    async def complete(self, request_id: str, request: Complete
                       ) -> AsyncIterator[Piece | Final]:
        try:
            ids, sampling = parse_completion(request, self.tokenizer, self.max_seq_len)
        except RequestError as exc:
            yield exc.event()
            return
        stream = Stream(self.tokenizer, self.eos, request_id, ids, sampling)
        self.serial += 1
        stream.engine_id = f"{stream.request_id}#{self.serial}"  # ids may come again
        self.streams[stream.request_id] = stream
        try:
            self._submit(stream)
            async for event in stream.events():
                yield event
        finally:
            if self.streams.get(stream.request_id) is stream:
                del self.streams[stream.request_id]
            if not stream.finished:  # cancelled, or the caller stopped listening
                stream.cancelled = True
                self._abort(stream)

    async def embed(self, texts: tuple[str, ...]) -> Final:
        return RequestError("this endpoint serves completions, not embeddings").event()

    def cancel(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.cancel()
            self._abort(stream)

    def _submit(self, stream: Stream) -> None:
        raise NotImplementedError

    def _abort(self, stream: Stream) -> None:
        """Stop generating for a cancelled stream (the batcher notices the flag itself)."""


class EmbedEngine:
    """An encoder, mean-pooled over the attention mask and L2-normalised, as the embed job;
    one request at a time in the model's thread, its texts in batches of EMBED_BATCH."""

    task = "embed"

    def __init__(self, tokenizer, model, settings: Settings, max_seq_len: int) -> None:
        from gpumarket.provider.runners.embed import choose_batch
        from gpumarket.provider.runners.inference import (
            attention_words, bucket, choose_attention,
        )

        self.tokenizer, self.model, self.max_seq_len = tokenizer, model, max_seq_len
        self.max_concurrency = settings.max_concurrency
        self.description = f"embed (transformers {type(model).__name__}) on {model.device.type}"
        # on CUDA: texts padded to a bucket, batches from free memory, attention measured
        step = bucket(model.device)
        self.bucket = step if step and max_seq_len % step == 0 else None
        self.batch = choose_batch({}, model, model.device, max_seq_len) \
            if model.device.type == "cuda" else EMBED_BATCH
        attention = choose_attention(model, model.device, self.batch)
        if attention:
            self.description += f" (attention {attention_words(model, attention)})"
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="embed")  # one owns the model

    async def complete(self, request_id: str, request: Complete
                       ) -> AsyncIterator[Piece | Final]:
        yield RequestError("this endpoint serves embeddings, not completions").event()

    async def embed(self, texts: tuple[str, ...]) -> Final:
        texts = list(texts)     # checked by the protocol: 1 to MAX_INPUTS strings
        lengths = [len(ids) for ids in self.tokenizer(texts)["input_ids"]]
        if max(lengths) > self.max_seq_len:
            i = lengths.index(max(lengths))
            return RequestError(f"input {i} has {lengths[i]} tokens, over this endpoint's"
                                f" max_seq_len {self.max_seq_len}").event()
        vectors = await asyncio.get_running_loop().run_in_executor(self.thread, self._vectors,
                                                                    texts)
        return Final(embeddings=vectors, prompt_tokens=sum(lengths))

    def _vectors(self, texts: list[str]) -> list[list[float]]:
        import torch

        from gpumarket.provider.runners.embed import pool

        out = []
        for start in range(0, len(texts), self.batch):
            enc = self.tokenizer(texts[start:start + self.batch], return_tensors="pt",
                                 padding=True, pad_to_multiple_of=self.bucket
                                 ).to(self.model.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            out += pool(hidden, enc["attention_mask"], True).float().cpu().tolist()
        return out

    def cancel(self, request_id: str) -> None:
        pass  # an embedding request is one short call

    async def close(self) -> None:
        self.thread.shutdown(wait=False)


def model_seq_len(settings: Settings, config, tokenizer=None) -> int:
    """The endpoint's max_seq_len: the one asked for, else the longest sequence the model
    takes, at most MAX_SEQ_LEN_CAP; raises JobError for one over the model's positions."""
    positions = getattr(config, "max_position_embeddings", None)
    if settings.max_seq_len:
        if positions and settings.max_seq_len > positions:
            raise JobError(f"max_seq_len {settings.max_seq_len} is over the model's"
                           f" max_position_embeddings {positions}")
        return settings.max_seq_len
    limits = [positions or MAX_SEQ_LEN_CAP, MAX_SEQ_LEN_CAP]
    if tokenizer is not None and 0 < (getattr(tokenizer, "model_max_length", 0) or 0) < 1e9:
        limits.append(int(tokenizer.model_max_length))
    return min(limits)


def load_engine(job: RunnerJob, workdir: Path) -> Engine:
    """The engine the endpoint's params ask for, with its model loaded (job.json's
    ``params``, ``inputs``, ``model_dir`` and ``device``); raises JobError."""
    settings = Settings.from_params(job.params)
    device = torch_device(job)
    dtype = torch_dtype(settings.dtype, device)
    model_dir = unpack_model(job, "model", workdir)
    remote = settings.trust_remote_code  # the daemon checked its policy allows it
    choice = settings.engine if settings.engine not in ("", "auto") else \
        "continuous" if device.type == "cuda" else CPU_DEFAULT
    if settings.task == "embed":
        if choice == "vllm":
            raise JobError("engine vllm: serves only task generate here")
        from transformers import AutoModel, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                                      trust_remote_code=remote)
            model = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=dtype,
                                              use_safetensors=True, trust_remote_code=remote)
        except (OSError, ValueError) as exc:
            raise JobError(f"model: cannot load ({str(exc).splitlines()[0]})") from exc
        seq = model_seq_len(settings, model.config, tokenizer)
        return EmbedEngine(tokenizer, model.to(device).eval(), settings, seq)
    if choice == "vllm":
        from gpumarket.provider.runners.batching import VllmEngine

        return VllmEngine(model_dir, settings, job)
    from gpumarket.provider.runners.batching import BatchEngine, ContinuousEngine
    from gpumarket.provider.runners.generate import load

    tokenizer, model = load(model_dir, device, dtype, remote)
    seq = model_seq_len(settings, model.config)
    if choice == "batch":
        from gpumarket.provider.runners.inference import attention_words, choose_attention

        attention = choose_attention(model, device, settings.max_concurrency)
        engine = BatchEngine(tokenizer, model, settings, seq)
        if attention:
            engine.description += f" (attention {attention_words(model, attention)})"
        return engine
    return ContinuousEngine(tokenizer, model, settings, seq)
