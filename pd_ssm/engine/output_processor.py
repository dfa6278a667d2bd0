"""After each sampled token: detokenize incrementally, apply stop rules, build RequestOutputs.

Stop rules, in vLLM's order: EOS (unless ignore_eos), a stop token id, a stop string (the text is
cut before it unless include_stop_str_in_output), max_tokens, the model length.  EOS and stop
tokens are not counted before `min_tokens` tokens exist.  Each request keeps its own detokenizer,
created lazily, so imported requests (StatePages) rebuild it from their output tokens.  A request
with `detokenize=False` gets no text and costs no decoding (vLLM's meaning).
"""

from __future__ import annotations

import math

from pd_ssm.engine.request import Request
from pd_ssm.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop
from pd_ssm.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._text_len: dict[str, int] = {}  # length of text already returned to the client

    def append(self, req: Request, token: int, logprobs: dict[int, float] | None) -> str:
        """Add a sampled token to the request, decide whether it finishes; return new text."""
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        p = req.params
        rule = self._text_free_rule(req, token)
        if not p.detokenize:
            if rule is not None:
                req.finish(*rule)
            return ""
        detok = self._detokenizer(req)
        if rule is not None and rule[0] == "stop":
            # EOS adds no text; as in vLLM, a stop token's text stays (unless it is a special token)
            req.output_text += (detok.add(token) if rule[1] is not None else "") + detok.flush()
            req.finish(*rule)
            return self._flush(req)
        req.output_text += detok.add(token)
        if p.stop and len(req.output_token_ids) >= p.min_tokens:
            start = max(0, self._text_len.get(req.req_id, 0) - max(len(s) for s in p.stop))
            hit = find_stop(req.output_text, p.stop, start)
            if hit is not None:
                stop_str = next(s for s in p.stop if req.output_text.startswith(s, hit))
                cut = hit + len(stop_str) if p.include_stop_str_in_output else hit
                req.output_text = req.output_text[:cut]
                req.finish("stop", stop_str)
                return self._flush(req)
        if rule is not None:  # a length limit: checked after the stop strings, as vLLM does
            req.output_text += detok.flush()  # a character cut off by the limit shows as U+FFFD
            req.finish(*rule)
        return self._flush(req)

    def _text_free_rule(self, req: Request, token: int) -> tuple[str, int | None] | None:
        """(finish reason, stop token) of the rules that need no text, in vLLM's order: EOS, a stop
        token id (neither before min_tokens), then the length limits; None if none applies."""
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens and token in self.eos and not p.ignore_eos:
            return "stop", None
        if n_out >= p.min_tokens and token in p.stop_token_ids:
            return "stop", token
        # NOTE: tokens read so far, not req.num_tokens: a later step may already be in flight
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return "length", None
        return None

    def output(self, req: Request, new_tokens: list[int], new_text: str) -> RequestOutput:
        """The request's output after a step that added `new_tokens` / `new_text`; with
        output_kind "delta" the completion holds only those (no per-step copy of the history)."""
        lp = req.logprobs if req.params.logprobs is not None else None
        cum = None
        if lp:
            cum = sum(d.get(t, -math.inf) for d, t in zip(lp, req.output_token_ids, strict=False))
        delta = req.params.output_kind == "delta"
        comp = CompletionOutput(
            index=0,
            text=new_text if delta else req.output_text,
            token_ids=list(new_tokens) if delta else list(req.output_token_ids),
            cumulative_logprob=cum,
            logprobs=(lp[len(lp) - len(new_tokens):] if delta else list(lp)) if lp is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=req.req_id,
            prompt=req.prompt,
            # NOTE: shared, not copied (a request's prompt never changes): a per-step copy would cost
            # O(prompt) per sequence and step
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=req.finished,
            new_token_ids=new_tokens,
            new_text=new_text,
        )

    def forget(self, req_id: str) -> None:
        self._detok.pop(req_id, None)
        self._text_len.pop(req_id, None)

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        detok = self._detok.get(req.req_id)
        if detok is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens
            )
            # an imported request resumes: replay its earlier outputs so text offsets line up
            text = "".join(detok.add(t) for t in req.output_token_ids[:-1])
            if not req.output_text:
                req.output_text = text
            self._detok[req.req_id] = detok
            self._text_len[req.req_id] = len(req.output_text)
        return detok

    def _flush(self, req: Request) -> str:
        """Text the client has not seen yet (held back while a stop string may still form)."""
        sent = self._text_len.get(req.req_id, 0)
        hold = 0 if req.finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        upto = max(sent, len(req.output_text) - hold)
        self._text_len[req.req_id] = upto
        if req.finished:
            self.forget(req.req_id)
        return req.output_text[sent:upto]
