"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response format.

Tokenizing and template rendering are request-sized work: they run on the app's prompt
pool (``ServerContext.prompt_work``), never on the event loop, after the prompt's size has
been checked (``prompt_size.py``). Token ids are checked against the vocabulary before
decoding.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from pagewarden.server.context import ServerContext
from pagewarden.server.errors import APIError
from pagewarden.server.protocol import DetokenizeRequest, TokenizeRequest


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
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the client's input
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
    else:
        assert req.prompt is not None
        text = req.prompt
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": ctx.engine.max_model_len,
        "tokens": ids,
        "token_strs": [tok.decode([t], skip_special_tokens=False) for t in ids]
        if req.return_token_strs
        else None,
    }


def _detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict:
    vocab = ctx.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token ids must be in [0, {vocab}), got {bad}", "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}
