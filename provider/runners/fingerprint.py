"""Activation fingerprints on torch (kinds/fingerprints.py has the format and the comparison):
``Recorder`` keeps them while ``model.generate`` runs, ``prefill`` makes a checker's from one
forward pass over a prompt plus the tokens a provider says it generated, and ``Committer``
a replica's from the same pass where its engine records none while it generates.

The state fingerprinted is the output embedding's input (the last hidden state, after the
final norm) at the position that produced a token: the one a greedy or sampled step reads
its logits from. ``generate`` asks the model for the last position's logits only, so a
pre-hook on the output embedding sees exactly that state at each step, prefill included."""

from __future__ import annotations

import inspect
import logging
import math

from gpumarket.kinds import fingerprints as fp

log = logging.getLogger(__name__)

# What a check's prefill takes a sampler to be: the logits as the model makes them, then the
# request's temperature and top_p alone. transformers' ``generate`` also applies what a
# model's own generation_config.json sets (a repetition penalty, min_p, a minimum length...),
# which would move an honest provider's greedy tokens off the replay's top ones and its
# sampled ones off the distribution the check judges them by: the runners pass these to
# every ``generate`` and continuous batching config, so they sample as they are checked.
AS_CHECKED = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
              "no_repeat_ngram_size": 0, "min_new_tokens": 0, "min_p": 0.0, "typical_p": 1.0,
              "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def _top(states, k: int):
    """The top-k entries by magnitude of each row of ``states`` (n x hidden): their indices
    (int32) and values (float16, clamped to its range)."""
    import torch

    vectors = states.float()
    top = torch.topk(vectors.abs(), k, dim=-1).indices
    values = torch.gather(vectors, -1, top).clamp(-fp.HALF_MAX, fp.HALF_MAX)
    return top.to(torch.int32), values.to(torch.float16)


def _encode_top(indices, values) -> list[str]:
    return [fp.encode(i.tolist(), v.float().tolist())
            for i, v in zip(indices.cpu(), values.cpu())]


def _encode_rows(states, k: int) -> list[str]:
    """Fingerprints of each row of ``states`` (n x hidden, any float dtype)."""
    return _encode_top(*_top(states, k))


def encode_state(state, k: int) -> str:
    """The fingerprint of one hidden state (a vector)."""
    return _encode_rows(state[None, :], k)[0]


def usable(model) -> bool:
    """Whether fingerprints can be made for this model: it has an output embedding and a
    hidden state narrow enough for uint16 indices."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and 0 < hidden_size(model) <= fp.MAX_INDEX + 1


def hidden_size(model) -> int:
    head = model.get_output_embeddings()
    return int(getattr(head, "in_features", 0) or head.weight.shape[-1])


class Recorder:
    """While ``model.generate`` runs in its ``with`` block: the top-k entries of the output
    embedding's input at each step, last position, per row (kept on the model's device as
    int32 indices and float16 values: 6 bytes an entry, k x rows x steps, not the whole
    hidden state of every step), until ``rows``."""

    def __init__(self, model) -> None:
        self.model, self.steps, self.handle = model, [], None
        self.k = fp.k_for(hidden_size(model))

    def __enter__(self) -> Recorder:
        self.steps = []
        self.handle = self.model.get_output_embeddings().register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _hook(self, module, args) -> None:
        self.steps.append(_top(args[0][:, -1, :].detach(), self.k))

    def rows(self, generated: list[int]) -> list[list[str]]:
        """The fingerprints of each row of the batch, which generated ``generated[r]``
        tokens (fp.positions of them)."""
        import torch

        if not self.steps:
            return [[] for _ in generated]
        indices = torch.stack([i for i, _ in self.steps], dim=1)     # batch x steps x k
        values = torch.stack([v for _, v in self.steps], dim=1)
        out = []
        for r, n in enumerate(generated):
            at = [j for j in fp.positions(n) if j < indices.shape[1]]
            out.append(_encode_top(indices[r, at], values[r, at]) if at else [])
        return out


class StepStates:
    """For an engine that decodes step by step (batching.Rows): a pre-hook on the output
    embedding keeps the last position's input of each forward, each row's state that
    produced its next token; ``note`` gives a Stream its fingerprints from it."""

    def __init__(self, model) -> None:
        self.state, self.k = None, 0
        if usable(model):
            self.k = fp.k_for(hidden_size(model))
            model.get_output_embeddings().register_forward_pre_hook(self._keep)

    def _keep(self, module, args) -> None:
        self.state = args[0][:, -1, :].detach()

    def note(self, stream, ids: list[int], row: int) -> None:
        """``stream``'s newest token (the last of ``ids``) came from row ``row`` of the last
        forward: fingerprint its state if it is the last of fp.EVERY, else keep it for the
        stream's end (engine.Stream.end)."""
        if not self.k or self.state is None or not hasattr(stream, "last_state"):
            return          # (a stand-in for a Stream that keeps no fingerprints)
        if stream.prints is None:
            stream.prints, stream.k = [], self.k
        if len(ids) % fp.EVERY == 0:
            stream.prints.append(encode_state(self.state[row], self.k))
            stream.last_state = None
        else:
            stream.last_state = self.state[row].clone()


def _left_padded(rows: list[tuple[list[int], list[int]]]):
    """prompt + generated of each row as one left-padded batch: ids, mask, positions (counted
    from each row's first real token, as ``generate`` counts them) and the width."""
    import torch

    width = max(len(p) + len(g) for p, g in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (p, g) in enumerate(rows):
        seq = p + g
        ids[r, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[r, width - len(seq):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), width


def _forward(model, rows, device, keep):
    """One forward pass without a cache over ``rows`` (``_left_padded``): the logits and the
    output embedding's inputs (the states fingerprinted) at the positions ``keep`` names
    (an int: that many last positions; a 1-D tensor: those columns) where the model takes
    ``logits_to_keep``, else at every position; and the batch's width."""
    import torch

    ids, mask, position_ids, width = _left_padded(rows)
    extra = {"logits_to_keep": keep} if "logits_to_keep" in inspect.signature(
        model.forward).parameters else {}
    seen = []
    handle = model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append(args[0].detach()))
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                           position_ids=position_ids.to(device), use_cache=False,
                           **extra).logits
    finally:
        handle.remove()
    return logits, seen[-1], width, bool(extra)


def prefill(model, rows: list[tuple[list[int], list[int]]], device
            ) -> list[tuple[list[str], float]]:
    """For each (prompt ids, generated ids): the fingerprints of the generated ids and their
    token gap, as ``prefill_rows`` makes them."""
    return [(r["fingerprints"], r["token_gap"]) for r in prefill_rows(model, rows, device)]


def prefill_rows(model, rows: list[tuple[list[int], list[int]]], device,
                 sampling: list[tuple[float, float] | None] | None = None) -> list[dict]:
    """For each (prompt ids, generated ids): {"fingerprints": the fingerprints of the
    generated ids as one forward pass over prompt + generated sees them, "token_gap": the
    largest gap, over the generated ids, between a position's top logit and the generated
    id's, in standard deviations of that position's logits (0 for a greedy provider that
    computed as the replay did)}, and for a row whose ``sampling`` is (temperature > 0,
    top_p), "draws": how its tokens sit in that distribution (``drawn``). One left-padded
    batch, positions counted from each row's first real token (as ``generate`` counts
    them)."""
    import torch

    k = fp.k_for(hidden_size(model))
    # Only the last positions matter (the generated tokens sit at the right of every row):
    # logits of those alone, not of every prompt token times the vocabulary.
    keep = max(len(g) for _, g in rows) + 1
    logits, states, width, _ = _forward(model, rows, device, keep)
    offset = width - states.shape[1]      # positions cut away on the left (logits_to_keep)
    logits = logits[:, -states.shape[1]:]
    out = []
    for r, (p, g) in enumerate(rows):
        drawing = sampling[r] if sampling else None
        if not g or not p:        # nothing generated, or no position it could come from
            out.append({"fingerprints": [], "token_gap": 0.0,
                        **({"draws": drawn(None, [], *drawing)} if drawing else {})})
            continue
        # the state at position i produced token i + 1: generated token j came from
        # position len(p) - 1 + j (of the row's own positions; the row starts at width - len)
        start = width - len(g) - 1 - offset
        at = [start + j for j in fp.positions(len(g))]
        prints = _encode_rows(states[r, at], k)
        row_logits = logits[r, start:start + len(g)].float()
        chosen = row_logits.gather(-1, torch.tensor(g, device=row_logits.device)[:, None])[:, 0]
        spread = row_logits.std(dim=-1).clamp(min=1e-12)
        gap = ((row_logits.max(dim=-1).values - chosen) / spread).max().item()
        record = {"fingerprints": prints, "token_gap": float(gap)}
        if drawing:
            record["draws"] = drawn(row_logits, g, *drawing)
        out.append(record)
    return out


DRAW_CHUNK = 64     # positions whose float64 distributions are held at once


def drawn(logits, ids: list[int], temperature: float, top_p: float) -> dict:
    """How sampled ``ids`` sit in the distributions their ``logits`` (one row per id) give
    at ``temperature`` and ``top_p`` (kinds/draws.py has the figures' meaning): {"tokens":
    n, "outside": the largest gap between the least likely nucleus member's logit and an
    id's, in standard deviations of that position's logits (at most 0 inside the nucleus),
    "least": the least u, "fisher": -2 sum(log u)}; the provider's sampler's nucleus (the
    smallest set of most likely tokens whose mass reaches top_p) computed in float64."""
    import torch

    from gpumarket.kinds.draws import LEAST_U

    if logits is None or not ids:
        return {"tokens": 0, "outside": 0.0, "least": 1.0, "fisher": 0.0}
    top_p = top_p if 0 < top_p < 1 else 1.0
    outside, least, fisher = -math.inf, 1.0, 0.0
    chosen_all = torch.tensor(ids, device=logits.device)
    for start in range(0, len(ids), DRAW_CHUNK):
        raw = logits[start:start + DRAW_CHUNK].double()
        logp = torch.log_softmax(raw / temperature, -1)
        probs = logp.exp()
        at = chosen_all[start:start + DRAW_CHUNK, None]
        chosen, chosen_log = probs.gather(-1, at), logp.gather(-1, at)[:, 0]
        ordered, order = probs.sort(-1, descending=True)
        kept = ordered.cumsum(-1) - ordered < top_p           # the nucleus, as sampled
        mass = (ordered * kept).sum(-1)                      # its mass
        last = kept.sum(-1, keepdim=True) - 1                # its least likely member
        edge_log = logp.gather(-1, order.gather(-1, last))[:, 0]
        spread = raw.std(dim=-1).clamp(min=1e-12)
        outside = max(outside, float(((edge_log - chosen_log) * temperature / spread).max()))
        smallest = ordered.gather(-1, last)
        # the nucleus mass at most as likely as the id over the nucleus mass; an id outside
        # the nucleus (by rounding, within the margin) counts as its least likely member
        below = (probs * (probs <= chosen) * (probs >= smallest)).sum(-1)
        u = torch.maximum(below, smallest[:, 0]) / mass
        u = u.clamp(min=LEAST_U, max=1.0)
        least = min(least, float(u.min()))
        fisher += float(-2 * torch.log(u).sum())
    return {"tokens": len(ids), "outside": max(outside, 0.0), "least": least,
            "fisher": fisher}


def commit(model, rows: list[tuple[list[int], list[int]]], device) -> list[list[str]]:
    """For each (prompt ids, generated ids): the fingerprints ``prefill`` makes of them (the
    same forward pass, positions and states), for a replica that commits to answers it
    generated without recording them (Committer). Logits are computed only at the
    fingerprinted positions: a replica needs no token gap, and a gap's logits are the
    vocabulary times every generated token."""
    import torch

    k = fp.k_for(hidden_size(model))
    width = max(len(p) + len(g) for p, g in rows)

    def columns(p: list[int], g: list[int]) -> list[int]:
        # generated token j came from column width - len(g) - 1 + j (as in prefill)
        return [width - len(g) - 1 + j for j in fp.positions(len(g))] if p and g else []

    wanted = sorted({c for p, g in rows for c in columns(p, g)})
    if not wanted:
        return [[] for _ in rows]
    _, states, _, kept = _forward(model, rows, device, torch.tensor(wanted, device=device))
    where = {c: i for i, c in enumerate(wanted)} if kept else {c: c for c in wanted}
    return [_encode_rows(states[r, [where[c] for c in columns(p, g)]], k)
            if columns(p, g) else [] for r, (p, g) in enumerate(rows)]


def twin(model):
    """The model's modules over the very same weights and buffers (no tensor is copied), with
    a config of their own. Continuous batching may switch its model's attention (an eager
    model to "paged|eager"; on CUDA to the fastest of batching.CUDA_PROBES), and "paged|eager"
    in a plain forward pass over a padded batch computes other states (on the tests' tiny
    Llama, 62 % of top entries shared with the checker's): a twin made before the switch
    keeps the attention the model was loaded with, which is the checker's, and hooks of its
    own while the manager's thread runs the model."""
    import copy

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


class Committer:
    """Fingerprints for an engine that generates without recording them (transformers
    continuous batching): each completion's Final, as it ends, waits for one prefill of its
    prompt + tokens on a ``twin`` of the model (``commit``), in a thread of its own (neither
    the engine's manager thread nor the event loop); the answers that end while one prefill
    runs go into the next together, up to BATCH rows. The Final then carries them, so the
    router samples its answers and a check compares them exactly as the batch engine's."""

    BATCH = 8     # answers a prefill takes at once (as a check's: answer_check.BATCH)

    def __init__(self, model) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.model, self.device = twin(model), model.device
        self.pending: list = []           # (Stream, Final) ended, not yet fingerprinted
        self.lock = threading.Lock()
        self.running = False
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")

    def __call__(self, stream, final) -> None:
        """``stream`` ended with ``final`` (its token ids, no fingerprints): fingerprint it,
        then deliver the Final (any thread may call)."""
        with self.lock:
            self.pending.append((stream, final))
            if self.running:
                return
            self.running = True
        try:
            self.thread.submit(self._drain)
        except RuntimeError:    # closed: the engine is stopping, its streams cancelled
            stream.deliver_failure("the engine is stopping")

    def _drain(self) -> None:
        import dataclasses

        while True:
            with self.lock:
                batch, self.pending = self.pending[:self.BATCH], self.pending[self.BATCH:]
                if not batch:
                    self.running = False
                    return
            try:
                prints = commit(self.model, [(s.prompt_ids, f.token_ids) for s, f in batch],
                                self.device)
            except Exception:
                # The answers are right and the client gets them; they commit to nothing, so
                # the replica fails the check of any of them the router kept (its pay, not
                # the client's answer, bears the engine's failure).
                log.exception("fingerprinting %d answers failed", len(batch))
                for stream, final in batch:
                    stream.deliver(final)
                continue
            for (stream, final), p in zip(batch, prints):
                stream.deliver(dataclasses.replace(final, fingerprints=p))

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
