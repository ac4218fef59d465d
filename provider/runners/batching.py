"""The completion engines of an endpoint (engine.py has their interface and chooses among
them): the dynamic batcher over ``model.generate``, transformers continuous batching, and
vLLM's AsyncLLM. Each turns a request's Stream into generated ids; the Stream makes the text
pieces, applies stop strings and limits, and times it, the same for all three."""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor

from gpumarket.provider.runners.base import JobError
from gpumarket.provider.runners.engine import (
    DEFAULT_MAX_TOKENS, GREEDY_TEMPERATURE, Generating, Sampling, Settings, Stream,
    model_seq_len,
)

log = logging.getLogger(__name__)

CPU_PAGE = 256  # tokens per page of the continuous batching KV cache on CPU


class BatchEngine(Generating):
    """The dynamic batcher: while the model is busy requests wait; when it is idle, up to
    max_concurrency waiting requests with the same sampling settings (all greedy ones alike)
    go into one left-padded ``generate`` call in a worker thread, whose stopping criterion
    streams each row's text and stops each row at its own limits."""

    def __init__(self, tokenizer, model, settings: Settings, max_seq_len: int) -> None:
        super().__init__(tokenizer, model.generation_config.eos_token_id, settings, max_seq_len)
        self.model = model
        self.description = f"batch (transformers generate) on {model.device.type}"
        self.waiting: list[Stream] = []
        self.wake = asyncio.Event()
        self.worker: asyncio.Task | None = None
        # one thread owns the model: each new calling thread would get its own OpenMP team
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="generate")

    def _submit(self, stream: Stream) -> None:
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
                stopping_criteria=StoppingCriteriaList([rows]))
        for stream, ids in zip(batch, out[:, width:].tolist()):
            if not stream.advance(ids):  # generate stopped before this row's own limits
                stream.end("length")

    async def close(self) -> None:
        for stream in [*self.streams.values(), *self.waiting]:
            stream.cancel()  # a running generate call stops at its next step
        if self.worker is not None:
            self.worker.cancel()
        self.thread.shutdown(wait=False)


class ContinuousEngine(Generating):
    """Transformers continuous batching: a paged KV cache and a background thread that adds
    and drops requests between steps, with each request's own temperature and top_p."""

    def __init__(self, tokenizer, model, settings: Settings, max_seq_len: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        super().__init__(tokenizer, model.generation_config.eos_token_id, settings, max_seq_len)
        self.description = f"continuous (transformers continuous batching) on {model.device.type}"
        # Placeholders other than 1.0 make transformers create the temperature and top_p
        # processors, which then take each request's values.
        config = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.5, top_k=None,
                                  max_new_tokens=DEFAULT_MAX_TOKENS,
                                  eos_token_id=sorted(self.eos) or None,
                                  pad_token_id=tokenizer.pad_token_id)
        sizes = {}
        if model.device.type == "cpu":  # on a GPU transformers sizes it from free memory
            sizes = {"page_size": CPU_PAGE, "max_batch_tokens": max(256, min(2048, max_seq_len)),
                     "num_blocks": (math.ceil(max_seq_len / CPU_PAGE) + 1) * self.max_concurrency}
        cb = ContinuousBatchingConfig(per_request_processors=True,
                                      max_requests_per_batch=self.max_concurrency, **sizes)
        self.manager = model.init_continuous_batching(generation_config=config,
                                                      continuous_batching_config=cb)
        if model.device.type == "cuda":  # capture CUDA graphs now, not on the first request
            self.manager.warmup()
        self.manager.start()

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
        await asyncio.to_thread(self.manager.stop, block=True, timeout=5)


class VllmEngine(Generating):
    """vLLM's AsyncLLM (its own continuous batching and paged KV cache) on all visible GPUs;
    the Streams only turn its cumulative token ids into text pieces and figures. Untested
    here: written from vLLM's AsyncLLM example, and no host of this repository has vllm."""

    def __init__(self, model_dir, settings: Settings, job: dict) -> None:
        try:
            import torch
            from vllm import SamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise JobError("engine vllm: the vllm package is not installed on this provider"
                           ) from exc
        from transformers import AutoConfig, AutoTokenizer

        if job.get("device") != "cuda" or not torch.cuda.is_available():
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
