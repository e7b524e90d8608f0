"""The OpenAI answers' parts the routes build from finished engine requests: choices' text, log-probabilities
in the completions shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, as OpenAI's legacy API
and vLLM give them) and the chat shape (`content`: token, logprob, bytes, top_logprobs), and usage."""

from __future__ import annotations

from collections.abc import Callable

from trainer.serve.logprobs import Logprob


def text_of(decode: Callable[[list[int]], str] | None, ids: list[int]) -> str:
    return decode(ids) if decode is not None else " ".join(map(str, ids))


def final_text(decode, req) -> str:
    """A finished request's text: cut before a stop string, without an end-of-document token it stopped at."""
    return req.text if req.text is not None else text_of(decode, req.text_ids)


def finish_reason(req) -> str:
    return "stop" if req.finish_reason == "stop" else "length"


def usage(requests: list, prompts: list[list[int]]) -> dict:
    """OpenAI's usage of one answer: each prompt counted once however many choices it has."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(r.output) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _top(decode, entry: Logprob, count: int) -> dict[str, float]:
    """The `count` best tokens' logprobs by their text, and the chosen token's (vLLM adds it when it is not
    among them). A token whose text an earlier (better) one has already (two byte tokens that each decode to
    U+FFFD, say) is named `token_id:ID`, as vLLM names tokens by id: every alternative asked for is there."""
    best: dict[str, float] = {}
    seen: set[int] = set()
    pairs = [*zip(entry.top_ids[:count], entry.top_logprobs[:count], strict=True), (entry.token, entry.logprob)]
    for token, logprob in pairs:
        if token in seen:  # the chosen token among the best
            continue
        seen.add(token)
        text = text_of(decode, [token])
        best[text if text not in best else f"token_id:{token}"] = logprob
    return best


def completion_logprobs(decode, req, count: int, echo: bool, start: int = 0, end: int | None = None,
                        offset: int = 0) -> dict:
    """`choices[i].logprobs` of /v1/completions: an entry a returned token (the prompt's first, with echo,
    has no logprob: nothing comes before it), each with its `count` best alternatives and its text's offset
    in the choice's text. A stream's chunk takes generated tokens start..end, its text starting at `offset`."""
    entries: list[Logprob | None] = [None, *req.prompt_logprobs] if echo else []
    entries += req.logprobs[start:end]
    tokens = ([req.prompt[0]] if echo else []) + [e.token for e in entries if e is not None]
    texts = [text_of(decode, [t]) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else _top(decode, e, count) for e in entries],
            "text_offset": offsets}


def chat_logprobs(decode, req, count: int, start: int = 0, end: int | None = None) -> dict:
    """`choices[i].logprobs` of /v1/chat/completions: {"content": [{token, logprob, bytes, top_logprobs}]}
    (a stream's chunk: of generated tokens start..end)."""

    def item(token: int, logprob: float) -> dict:
        text = text_of(decode, [token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = [{**item(e.token, e.logprob),
                "top_logprobs": [item(t, v) for t, v in zip(e.top_ids[:count], e.top_logprobs[:count], strict=True)]}
               for e in req.logprobs[start:end]]
    return {"content": content, "refusal": None}
