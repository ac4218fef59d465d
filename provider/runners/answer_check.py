"""A check of an endpoint's answers by their fingerprints (docs/verification.md): each
sampled answer is a request as the engine got it, the token ids the replica says it
generated and the fingerprints it committed to in its final message (engine_protocol.Final).
One prefill pass of each request's prompt (tokenized as the engine does: engine.
parse_completion) plus those ids, judged by the generate kind's fingerprint rule for the
endpoint's dtype, greedy requests by the token gap too."""

from __future__ import annotations

from gpumarket.kinds.engine_protocol import BadRequest, Complete
from gpumarket.kinds.generate import fingerprint_rule
from gpumarket.provider.runners import fingerprint
from gpumarket.provider.runners.engine import RequestError, parse_completion

MAX_SAMPLES = 64      # answers one check prefills (in batches of BATCH)
BATCH = 8


def check_answers(tokenizer, model, device, max_seq_len: int, samples: list[dict],
                  dtype: str) -> list[tuple[bool, str]]:
    """Per sample ({"request": a Complete as a dict, "token_ids": [...], "fingerprints":
    [...]}): (agrees, where it differs). A sample that is not one (a request the engine
    would refuse, ids outside the vocabulary) disagrees."""
    out: list[tuple[bool, str] | None] = [None] * len(samples)
    todo = []
    for n, sample in enumerate(samples[:MAX_SAMPLES]):
        try:
            request = Complete.from_dict(sample["request"])
            prompt_ids, sampling = parse_completion(request, tokenizer, max_seq_len)
            ids = sample["token_ids"]
            if not isinstance(ids, list) or not all(
                    type(t) is int and 0 <= t < len(tokenizer) for t in ids):
                raise ValueError("token ids outside the vocabulary")
        except (BadRequest, RequestError, KeyError, TypeError, ValueError) as exc:
            out[n] = (False, f"not a sample that can be checked ({exc})")
            continue
        todo.append((n, prompt_ids, ids, sampling.temperature <= 0))
    for start in range(0, len(todo), BATCH):
        batch = todo[start:start + BATCH]
        checked = fingerprint.prefill(model, [(p, g) for _, p, g, _ in batch], device)
        for (n, _, _, greedy), (prints, gap) in zip(batch, checked):
            same = fingerprint_rule(dtype, greedy)
            out[n] = same({"completion": "", "fingerprints": samples[n].get("fingerprints")},
                          {"completion": "", "fingerprints": prints, "token_gap": gap})
    return [o if o is not None else (False, "not checked: too many samples")
            for o in out]
