"""Turns the scheduler's per-child token updates into ``RequestOutput`` objects.

Owns detokenization and stop strings: a stop string found here is reported back so the
engine core can finish that child in the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagewarden.engine.detokenizer import IncrementalDetokenizer
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import PromptLogprobs, RequestUpdate, TokenLogprobs

logger = logging.getLogger("pagewarden.engine")


@dataclass
class _RequestState:
    output: RequestOutput
    params: SamplingParams
    detokenizers: list[IncrementalDetokenizer]
    done: list[bool] = field(default_factory=list)
    # Prompt logprobs by prompt position while the prompt is being scored (position 0
    # has none); handed to the output with the first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputProcessor:
    """Per-request output state, keyed by the user's request id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        outputs = [
            CompletionOutput(
                index=i, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
            )
            for i in range(params.n)
        ]
        self._states[request_id] = _RequestState(
            output=RequestOutput(request_id, prompt, prompt_token_ids, outputs),
            params=params,
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                for _ in range(params.n)
            ],
            done=[False] * params.n,
            prompt_logprobs=[None] * len(prompt_token_ids)
            if params.prompt_logprobs is not None
            else None,
        )

    def add_prompt_logprobs(self, request_id: str, chunk: PromptLogprobs) -> None:
        """Record prompt logprobs of ``request_id``; a recomputed position (after a
        preemption or a rollback) overwrites the same value."""
        state = self._states.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return
        scored = state.prompt_logprobs
        end = min(chunk.start + len(chunk.entries), len(scored))
        scored[chunk.start : end] = chunk.entries[: end - chunk.start]

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Finish every unfinished completion with ``reason`` and forget the request."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        for completion in state.output.outputs:
            if completion.finish_reason is None:
                completion.finish_reason = reason
        state.output.finished = True
        return state.output

    def process(self, updates: Iterable[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Apply updates; returns the changed outputs and the child ids stopped by a string."""
        changed: dict[str, RequestOutput] = {}
        stopped_children: list[str] = []
        for upd in updates:
            request_id = upd.parent_id if upd.parent_id is not None else upd.req_id
            state = self._states.get(request_id)
            if state is None or state.done[upd.index]:
                continue
            if state.output.prompt_logprobs is None and state.prompt_logprobs is not None:
                self._release_prompt_logprobs(request_id, state)
            completion = state.output.outputs[upd.index]
            detok = state.detokenizers[upd.index]
            completion.token_ids.extend(upd.new_token_ids)
            if completion.logprobs is not None:
                completion.logprobs.extend(upd.logprobs)
            delta = detok.add_tokens(upd.new_token_ids)
            # completion.text only ever grows by released text: text held back because it
            # may start a stop string is not shown until it is known not to be one.
            completion.text += delta.text
            finished = upd.finished
            if delta.stopped and not upd.finished:
                stopped_children.append(upd.req_id)
                finished = True
            if delta.stopped:
                completion.finish_reason, completion.stop_reason = "stop", delta.stop_string
            elif upd.finished:
                completion.text += detok.flush()
                completion.finish_reason, completion.stop_reason = (
                    upd.finish_reason,
                    upd.stop_reason,
                )
            state.output.num_cached_tokens = max(
                state.output.num_cached_tokens, upd.num_cached_tokens
            )
            if finished:
                state.done[upd.index] = True
            if all(state.done):
                state.output.finished = True
                del self._states[request_id]
            changed[request_id] = state.output
        return list(changed.values()), stopped_children

    @staticmethod
    def _release_prompt_logprobs(request_id: str, state: _RequestState) -> None:
        scored = state.prompt_logprobs
        assert scored is not None
        missing = [i for i, lp in enumerate(scored) if lp is None and i > 0]
        if missing:  # a scheduling path that skipped scoring: say so, never invent values
            logger.error(
                "request %s: prompt logprobs missing at %d prompt positions (first %d)",
                request_id,
                len(missing),
                missing[0],
            )
        state.output.prompt_logprobs = scored
