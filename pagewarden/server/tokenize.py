"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response format.

Tokenizing and template rendering are request-sized work: they run on the app's prompt
pool (``ServerContext.prompt_work``), never on the event loop, after the prompt's size has
been checked (``prompt_size.py``). Token ids are checked against the vocabulary before
decoding.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from pagewarden.server.chat import render_prompt
from pagewarden.server.context import ServerContext
from pagewarden.server.errors import APIError
from pagewarden.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from pagewarden.server.tools import ToolConfig, plan_tools


def add_tokenize_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        _, req = await ctx.read_request(request, TokenizeRequest)
        # By size, before any rendering or tokenizing (prompt_size.py).
        if req.prompt is not None:
            ctx.prompt_limit.check_text(len(req.prompt), "prompt")
        if req.messages is not None:
            ctx.prompt_limit.check_messages(req.messages)
        return await ctx.prompt_work(_tokenize, ctx, req)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        _, req = await ctx.read_request(request, DetokenizeRequest)
        return await ctx.prompt_work(_detokenize, ctx, req)


def _tokenize(ctx: ServerContext, req: TokenizeRequest) -> dict:
    tok = ctx.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        ids = _chat_prompt_ids(ctx, req)
    else:
        assert req.prompt is not None
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return {
        "count": len(ids),
        "max_model_len": ctx.engine.max_model_len,
        "tokens": ids,
        "token_strs": [tok.decode([t], skip_special_tokens=False) for t in ids]
        if req.return_token_strs
        else None,
    }


def _chat_prompt_ids(ctx: ServerContext, req: TokenizeRequest) -> list[int]:
    """The prompt ``/v1/chat/completions`` would run for these messages and tools (with
    ``add_special_tokens``, the tokenizer's own special tokens on top)."""
    chat = ChatCompletionRequest(
        model=req.model,
        messages=req.messages or [],
        tools=req.tools,
        tool_choice="none" if req.tools else None,
        add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    text, ids = render_prompt(chat, ctx, plan_tools(chat, ToolConfig()))
    if req.add_special_tokens and text is not None:
        ids = ctx.tokenizer.encode(text, add_special_tokens=True)
    return ids


def _detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict:
    vocab = ctx.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token ids must be in [0, {vocab}), got {bad}", "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}
