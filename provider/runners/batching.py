"""The completion engines of an endpoint (engine.py has their interface and chooses among
them): the dynamic batcher over ``model.generate``, transformers continuous batching, and
vLLM's AsyncLLM. Each turns a request's Stream into generated ids; the Stream makes the text
pieces, applies stop strings and limits, and times it, the same for all three."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from gpumarket.kinds.engine_protocol import DEFAULT_MAX_TOKENS
from gpumarket.provider.runners import fingerprint
from gpumarket.provider.runners.base import JobError
from gpumarket.provider.runners.engine import (
    GREEDY_TEMPERATURE, Generating, Sampling, Settings, Stream, model_seq_len,
)

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

log = logging.getLogger(__name__)

CPU_PAGE = 256  # tokens per page of the continuous batching KV cache on CPU
PROBE = True  # the switch for the continuous engine's probe of CUDA_PROBES on CUDA


class Rows:
    """The sequences a BatchEngine decodes together, one row each: one KV cache for all of
    them (transformers' DynamicCache, left-padded to the longest row), their attention mask
    and positions. ``admit`` prefills new prompts as a batch of their own and joins their
    cache to the rows' (each side padded on the left to the longer), so requests join between
    two decode steps; ``step`` decodes one token for every row; rows leave when their Stream
    says it is over, and the padding no row needs any more is cut away.

    Greedy rows take the argmax; a sampling row draws from its own generator (seeded by its
    request's seed), so what it draws does not depend on the rows beside it."""

    def __init__(self, model, pad_id: int) -> None:
        import inspect

        self.model, self.pad_id = model, pad_id
        params = inspect.signature(model.forward).parameters
        # transformers 5.2x calls the cache ``cache``; earlier versions ``past_key_values``
        # with an explicit ``cache_position``
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        self.logits_to_keep = "logits_to_keep" in params
        self.states = fingerprint.StepStates(model)   # each answer's activation fingerprints
        self.clear()

    def clear(self) -> None:
        self.streams: list[Stream] = []
        self.ids: list[list[int]] = []       # each row's generated ids
        self.generators: list = []           # each row's (torch.Generator, Sampling) or None
        self.cache = None
        self.mask = None                     # (rows, cached + 1) 0/1, left padding

    def __len__(self) -> int:
        return len(self.streams)

    def _forward(self, input_ids, mask, positions, cache):
        import torch

        kwargs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions,
                  "use_cache": True, self.cache_arg: cache}
        if self.cache_position:
            past = cache.get_seq_length()
            kwargs["cache_position"] = torch.arange(past, past + input_ids.shape[1],
                                                    device=input_ids.device)
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1, :]

    def check(self) -> str:
        """Why this model cannot be decoded step by step here ("" when it can): a prefill of
        two short prompts and one step must leave a cache of plain full-attention layers of
        the expected length (sliding-window, linear-attention or quantized caches are not
        joined this way)."""
        from transformers.cache_utils import DynamicLayer

        try:
            cache, mask, _ = self._prefill([[self.pad_id], [self.pad_id, self.pad_id]])
            self._decode(cache, mask, [[self.pad_id], [self.pad_id]])
        except Exception as exc:  # noqa: BLE001 (any failure means: not this way)
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        layers = getattr(cache, "layers", None)
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            return "its cache is not made of plain full-attention layers"
        if cache.get_seq_length() != 3:
            return "the model did not fill the cache it was given"
        return ""

    def _prefill(self, prompts: list[list[int]]):
        """A new cache of ``prompts`` (left-padded), their mask and last logits."""
        import torch
        from transformers import DynamicCache

        device = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts],
                           device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        return cache, mask, self._forward(ids, mask, positions, cache)

    def _decode(self, cache, mask, last: list[list[int]]):
        """Logits of the next token of every row, whose last tokens are ``last``; returns
        them and the mask grown by one column."""
        import torch

        device = self.model.device
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype, device=device)],
                         dim=1)
        positions = mask.sum(-1, keepdim=True) - 1
        return self._forward(torch.tensor(last, device=device), mask, positions, cache), mask

    def _pick(self, logits, generators: list) -> list[int]:
        import torch

        chosen = logits.argmax(-1).tolist()
        for row, drawing in enumerate(generators):
            if drawing is not None:
                gen, s = drawing
                probs = torch.softmax(logits[row].float() / s.temperature, dim=-1)
                if s.top_p < 1.0:
                    ordered, order = probs.sort(descending=True)
                    keep = ordered.cumsum(0) - ordered < s.top_p  # the smallest set over top_p
                    probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
                chosen[row] = int(torch.multinomial(probs, 1, generator=gen))
        return chosen

    def _generator(self, sampling: Sampling):
        import torch

        if sampling.temperature <= 0:
            return None
        gen = torch.Generator(device=self.model.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        else:
            gen.seed()
        return gen, sampling

    def admit(self, streams: list[Stream]) -> None:
        """Prefill ``streams``' prompts, give each its first token, and join them to the
        rows."""
        import torch
        import torch.nn.functional as F

        cache, mask, logits = self._prefill([s.prompt_ids for s in streams])
        generators = [self._generator(s.sampling) for s in streams]
        firsts = self._pick(logits, generators)
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            old, new = self.mask.shape[1], mask.shape[1]
            width = max(old, new)
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys = torch.cat([F.pad(mine.keys, (0, 0, width - old, 0)),
                                       F.pad(theirs.keys, (0, 0, width - new, 0))])
                mine.values = torch.cat([F.pad(mine.values, (0, 0, width - old, 0)),
                                         F.pad(theirs.values, (0, 0, width - new, 0))])
            self.mask = torch.cat([F.pad(self.mask, (width - old, 0)),
                                   F.pad(mask, (width - new, 0))])
        firsts = [[t] for t in firsts]
        for row, (stream, ids) in enumerate(zip(streams, firsts)):
            self.states.note(stream, ids, row)
        self.streams += streams
        self.ids += firsts
        self.generators += generators
        self._settle()

    def step(self) -> None:
        """One decode step for every row."""
        logits, self.mask = self._decode(self.cache, self.mask, [[ids[-1]] for ids in self.ids])
        for row, (stream, ids, token) in enumerate(zip(self.streams, self.ids,
                                                       self._pick(logits, self.generators))):
            ids.append(token)
            self.states.note(stream, ids, row)
        self._settle()

    def _settle(self) -> None:
        """Each row's Stream takes its ids; the rows it ends leave, with the padding columns
        no remaining row needs."""
        import torch

        keep = [i for i, (stream, ids) in enumerate(zip(self.streams, self.ids))
                if not stream.advance(ids)]
        if len(keep) == len(self.streams):
            return
        if not keep:
            self.clear()
            return
        self.streams = [self.streams[i] for i in keep]
        self.ids = [self.ids[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        index = torch.tensor(keep, device=self.mask.device)
        self.mask = self.mask[index]
        cut = int((self.mask.cumsum(-1) == 0).sum(-1).min())  # padding every row has
        self.mask = self.mask[:, cut:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, cut:]
            layer.values = layer.values[index, :, cut:]


class BatchEngine(Generating):
    """The batcher of a CPU endpoint (and of one that asks for engine "batch"): one thread
    owns the model and decodes every request in flight together, one token a step (Rows);
    requests that arrive while it runs join at the next step, up to max_concurrency, so one
    long request does not hold the others' first tokens (issue 32: 14 of 16 concurrent
    streams waited ~68 s for a generate call to end).

    ``stepwise=False``, or a model whose cache Rows cannot join (Rows.check), keeps the
    former path: while the model is busy requests wait; when it is idle, up to
    max_concurrency waiting requests with the same sampling settings go into one left-padded
    ``generate`` call, whose stopping criterion streams each row's text and stops each row
    at its own limits."""

    def __init__(self, tokenizer, model, settings: Settings, max_seq_len: int,
                 stepwise: bool = True) -> None:
        super().__init__(tokenizer, model.generation_config.eos_token_id, settings, max_seq_len)
        self.model = model
        self.waiting: list[Stream] = []
        self.wake = asyncio.Event()
        self.worker: asyncio.Task | None = None
        # one thread owns the model: each new calling thread would get its own OpenMP team
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="generate")
        self.rows = Rows(model, tokenizer.pad_token_id) if stepwise else None
        why = self.thread.submit(self._check).result() if stepwise else "asked for"
        if why:
            self.rows = None
            self.description = (f"batch (one transformers generate call at a time: {why})"
                                f" on {model.device.type}")
        else:
            self.description = (f"batch (step-wise decode, requests join between steps) on"
                                f" {model.device.type}")
        self.arrivals: list[Stream] = []         # for the stepping thread, under ``lock``
        self.lock = threading.Condition()
        self.closed = False
        self.stepping = None

    def _check(self) -> str:
        import torch

        with torch.inference_mode():
            return self.rows.check()  # also the first call of each kernel, before a request

    def _submit(self, stream: Stream) -> None:
        if self.rows is not None:
            with self.lock:
                self.arrivals.append(stream)
                self.lock.notify()
            if self.stepping is None:
                self.stepping = self.thread.submit(self._steps)
            return
        self._submit_call(stream)

    def _steps(self) -> None:
        """The stepping thread: admit arrivals (as many as free rows), decode one step, until
        the engine closes."""
        import torch

        rows = self.rows
        while True:
            with self.lock:
                while not self.closed and not self.arrivals and not len(rows):
                    self.lock.wait()
                if self.closed:
                    break
                arrivals = [s for s in self.arrivals if not s.cancelled]
                room = max(0, self.max_concurrency - len(rows))
                admit, self.arrivals = arrivals[:room], arrivals[room:]
            try:
                with torch.inference_mode():
                    if admit:
                        rows.admit(admit)
                    if len(rows):
                        rows.step()
            except Exception:
                log.exception("decoding failed with %d requests in flight",
                              len(rows) + len(admit))
                for stream in {*rows.streams, *admit}:
                    stream.fail("the engine failed while generating")
                rows.clear()
        for stream in [*rows.streams, *self.arrivals]:
            stream.cancel()
        rows.clear()

    def _submit_call(self, stream: Stream) -> None:
        self.waiting.append(stream)
        self.wake.set()
        if self.worker is None:
            self.worker = asyncio.get_running_loop().create_task(self._run())

    @staticmethod
    def _key(s: Sampling) -> tuple:
        return (s.temperature, s.top_p, s.seed) if s.temperature > 0 else ()

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.waiting:
                key = self._key(self.waiting[0].sampling)
                batch = [s for s in self.waiting if self._key(s.sampling) == key
                         and not s.cancelled][:self.max_concurrency]
                self.waiting = [s for s in self.waiting if s not in batch and not s.cancelled]
                if not batch:
                    continue
                try:
                    await asyncio.get_running_loop().run_in_executor(
                        self.thread, self._generate, batch)
                except Exception:
                    log.exception("generate failed for a batch of %d requests", len(batch))
                    for s in batch:
                        s.fail("the engine failed while generating")

    def _generate(self, batch: list[Stream]) -> None:
        import torch
        from transformers import StoppingCriteriaList

        enc = self.tokenizer.pad({"input_ids": [s.prompt_ids for s in batch]},
                                 return_tensors="pt").to(self.model.device)
        width = enc["input_ids"].shape[1]

        def rows(input_ids, scores, **kwargs):
            over = [s.advance(ids) for s, ids in zip(batch, input_ids[:, width:].tolist())]
            return torch.tensor(over, dtype=torch.bool, device=input_ids.device)

        s = batch[0].sampling
        if s.temperature > 0 and s.seed is not None:
            torch.manual_seed(s.seed)
        with torch.inference_mode():
            out = self.model.generate(
                **enc, max_new_tokens=max(x.sampling.max_tokens for x in batch),
                do_sample=s.temperature > 0, temperature=s.temperature or None,
                top_p=s.top_p if s.temperature > 0 else None, top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([rows]), **fingerprint.AS_CHECKED)
        for stream, ids in zip(batch, out[:, width:].tolist()):
            if not stream.advance(ids):  # generate stopped before this row's own limits
                stream.end("length")

    async def close(self) -> None:
        for stream in [*self.streams.values(), *self.waiting]:
            stream.cancel()  # a running generate call (or step) stops at its next step
        with self.lock:
            self.closed = True
            self.lock.notify()
        if self.worker is not None:
            self.worker.cancel()
        self.thread.shutdown(wait=False)


# On CUDA, the continuous engine's settings tried at start, each on a burst of
# max_concurrency requests of PROBE_TOKENS tokens; the fastest serves. (attention, CUDA
# graphs): on an H100, with graphs off, "paged|eager" ran 2,355 tokens/s at 64 in flight and
# "sdpa" 2,195 with cuDNN's attention off, 708 with it on (issue 31); graphs not yet measured.
# Where flash-attn is installed, flash_attention_2 with graphs off and on instead.
CUDA_PROBES = (("sdpa", False), ("paged|eager", False), ("sdpa", True), ("paged|eager", True))
PROBE_TOKENS = 32


def cb_config(**fields):
    """A ContinuousBatchingConfig of the ``fields`` this transformers has (its fields moved
    between 5.x releases: a provider may run another than the one measured)."""
    import dataclasses

    from transformers import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} \
        if dataclasses.is_dataclass(ContinuousBatchingConfig) else set(fields)
    return ContinuousBatchingConfig(**{k: v for k, v in fields.items() if k in known})


class ContinuousEngine(Generating):
    """Transformers continuous batching: a paged KV cache and a background thread that adds
    and drops requests between steps, with each request's own temperature and top_p. It
    records no fingerprints while it decodes: each answer's are made as it ends, by one
    prefill of its prompt + tokens (fingerprint.Committer), the checker's own pass.

    On CUDA its settings are chosen by measurement when it starts: SDPA's cuDNN kernel
    (choose_attention), then each of CUDA_PROBES on a short burst, the fastest kept; the
    choice is in its description (the replica's engine, in ``endpoint show``) and its log."""

    def __init__(self, tokenizer, model, settings: Settings, max_seq_len: int) -> None:
        from transformers import GenerationConfig

        from gpumarket.provider.runners.inference import attention_words, choose_attention

        super().__init__(tokenizer, model.generation_config.eos_token_id, settings, max_seq_len)
        self.description = f"continuous (transformers continuous batching) on {model.device.type}"
        # Placeholders other than 1.0 make transformers create the temperature and top_p
        # processors, which then take each request's values.
        self.generation = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.5,
                                           top_k=None, max_new_tokens=DEFAULT_MAX_TOKENS,
                                           eos_token_id=sorted(self.eos) or None,
                                           pad_token_id=tokenizer.pad_token_id,
                                           **fingerprint.AS_CHECKED)
        self.model = model
        # Its answers' fingerprints, by a prefill on a twin of the model made now, before
        # continuous batching may switch the attention (fingerprint.twin)
        self.committer = fingerprint.Committer(model) if fingerprint.usable(model) else None
        self.sizes = {}
        if model.device.type == "cpu":  # on a GPU transformers sizes it from free memory
            self.sizes = {"page_size": CPU_PAGE,
                          "max_batch_tokens": max(256, min(2048, max_seq_len)),
                          "num_blocks": (math.ceil(max_seq_len / CPU_PAGE) + 1)
                          * self.max_concurrency}
        chosen, why = None, ""
        if model.device.type == "cuda":
            attention = choose_attention(model, model.device, self.max_concurrency)
            chosen, why = self._probe(tokenizer)
            why = f"attention {attention_words(model, attention)}; {why}"
        self.manager = self._start(*(chosen or (None, None)))
        if why:
            self.description += f" ({why})"
            print(f"continuous batching: {why}", flush=True)

    def _start(self, attention: str | None, graphs: bool | None):
        """A started manager with ``attention`` and CUDA ``graphs`` (None: transformers'
        own choice)."""
        if attention is not None and attention != self.model.config._attn_implementation:
            self.model.set_attn_implementation(attention)
        extra = {} if graphs is None else {"use_cuda_graph": graphs,
                                           "auto_switch_to_flash": False}
        cb = cb_config(per_request_processors=True,
                       max_requests_per_batch=self.max_concurrency, **self.sizes, **extra)
        manager = self.model.init_continuous_batching(generation_config=self.generation,
                                                      continuous_batching_config=cb)
        if self.model.device.type == "cuda":  # capture CUDA graphs now, not on a request
            manager.warmup()
        manager.start()
        return manager

    def _probe(self, tokenizer) -> tuple[tuple[str, bool] | None, str]:
        """Each of CUDA_PROBES on max_concurrency requests of PROBE_TOKENS tokens; returns
        the fastest (None if none ran) and the figures in words."""
        import time

        prompt = tokenizer("a marketplace for idle gpus runs jobs")["input_ids"]
        figures, best = [], None
        probes = CUDA_PROBES
        try:
            from transformers.utils import is_flash_attn_2_available

            if is_flash_attn_2_available():   # transformers' own first choice for CB
                probes = (("flash_attention_2", False), ("flash_attention_2", True))
        except ImportError:
            pass
        for attention, graphs in (probes if PROBE else ()):
            began = time.perf_counter()
            try:
                manager = self._start(attention, graphs)
                try:
                    timed = time.perf_counter()
                    for i in range(self.max_concurrency):
                        manager.add_request(prompt, request_id=f"probe-{i}",
                                            max_new_tokens=PROBE_TOKENS,
                                            temperature=GREEDY_TEMPERATURE, top_p=1.0)
                    tokens = 0
                    for _ in range(self.max_concurrency):
                        out = manager.get_result(timeout=max(1.0, 120 - (time.perf_counter()
                                                                           - began)))
                        if out is None:
                            raise TimeoutError("the probe's requests did not end")
                        tokens += len(out.generated_tokens)
                    rate = tokens / (time.perf_counter() - timed)
                finally:
                    manager.stop(block=True, timeout=30)
            except Exception as exc:  # noqa: BLE001 (a setting this card or version lacks)
                log.warning("continuous batching with %s, CUDA graphs %s failed: %s",
                            attention, graphs, exc)
                figures.append(f"{attention}{' + graphs' if graphs else ''} failed")
                continue
            figures.append(f"{attention}{' + graphs' if graphs else ''} {rate:,.0f} tokens/s")
            if best is None or rate > best[0]:
                best = (rate, (attention, graphs))
        if best is None:
            return None, "settings by transformers (no probe ran)" if figures or not PROBE \
                else ""
        attention, graphs = best[1]
        return best[1], (f"{attention}, CUDA graphs {'on' if graphs else 'off'}, the fastest"
                         f" at {self.max_concurrency} in flight: {'; '.join(figures)}")

    def _submit(self, stream: Stream) -> None:
        def on_output(output) -> None:
            if output.error is not None:
                log.error("continuous batching failed request %s: %s", stream.engine_id,
                          output.error)
                stream.fail("the engine failed while generating")
            elif stream.advance(list(output.generated_tokens)):
                if not output.is_finished():  # a stop string: transformers knows none
                    self._abort(stream)
            elif output.is_finished():
                stream.end("length")

        stream.commit = self.committer
        self.manager.register_result_handler(stream.engine_id, on_output)
        s = stream.sampling
        added = self.manager.add_request(
            stream.prompt_ids, request_id=stream.engine_id, max_new_tokens=s.max_tokens,
            streaming=True, temperature=s.temperature or GREEDY_TEMPERATURE, top_p=s.top_p)
        if added is None:
            stream.fail("the engine is not accepting requests", 503)

    def _abort(self, stream: Stream) -> None:
        self.manager.cancel_request(stream.engine_id)
        # A cancelled request gets no last output, so its handler would stay registered; its
        # outputs still in flight then land in the shared queue, which nothing else reads.
        router = self.manager.output_router
        with router._lock:
            router.result_handlers.pop(stream.engine_id, None)
        while not router.output_queue.empty():
            router.output_queue.get_nowait()

    async def close(self) -> None:
        for stream in list(self.streams.values()):
            stream.cancel()
        if self.committer is not None:
            self.committer.close()
        await asyncio.to_thread(self.manager.stop, block=True, timeout=5)


class VllmEngine(Generating):
    """vLLM's AsyncLLM (its own continuous batching and paged KV cache) on all visible GPUs;
    the Streams only turn its cumulative token ids into text pieces and figures. Untested
    here: written from vLLM's AsyncLLM example, and no host of this repository has vllm."""

    def __init__(self, model_dir, settings: Settings, job: RunnerJob) -> None:
        try:
            import torch
            from vllm import SamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise JobError("engine vllm: the vllm package is not installed on this provider"
                           ) from exc
        from transformers import AutoConfig, AutoTokenizer

        if job.device != "cuda" or not torch.cuda.is_available():
            raise JobError("engine vllm: needs a CUDA device")
        remote, gpus = settings.trust_remote_code, torch.cuda.device_count()
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                                      trust_remote_code=remote)
            config = AutoConfig.from_pretrained(model_dir, local_files_only=True,
                                                trust_remote_code=remote)
            seq = model_seq_len(settings, config)
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
                model=str(model_dir), tokenizer=str(model_dir), dtype=settings.dtype or "auto",
                max_model_len=seq, max_num_seqs=settings.max_concurrency,
                trust_remote_code=remote, tensor_parallel_size=gpus))
        except (OSError, ValueError, RuntimeError) as exc:
            raise JobError(f"model: vLLM cannot load it ({str(exc).splitlines()[0]})") from exc
        super().__init__(tokenizer, getattr(config, "eos_token_id", None), settings, seq)
        self.description = f"vllm (AsyncLLM) on {gpus} GPU(s)"
        self.sampling_params = SamplingParams
        self.following: dict[str, asyncio.Task] = {}

    def _submit(self, stream: Stream) -> None:
        s = stream.sampling
        params = self.sampling_params(max_tokens=s.max_tokens, temperature=s.temperature,
                                      top_p=s.top_p, stop=list(s.stop) or None, seed=s.seed)
        task = asyncio.get_running_loop().create_task(self._follow(stream, params))
        self.following[stream.engine_id] = task
        task.add_done_callback(lambda t: self.following.pop(stream.engine_id, None))

    async def _follow(self, stream: Stream, params) -> None:
        try:
            async for out in self.llm.generate({"prompt_token_ids": stream.prompt_ids}, params,
                                               request_id=stream.engine_id):
                if stream.advance(list(out.outputs[0].token_ids)):
                    return  # leaving the generator aborts the request in vLLM
                if out.finished:
                    stream.end("length" if out.outputs[0].finish_reason == "length" else "stop")
        except Exception:
            log.exception("vLLM failed request %s", stream.engine_id)
            stream.fail("the engine failed while generating")

    def _abort(self, stream: Stream) -> None:
        task = self.following.get(stream.engine_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for task in list(self.following.values()):
            task.cancel()
        self.llm.shutdown()
