"""/v1/embeddings: LLM.embed over the inputs of a request (one batch), as floats or base64 float32, optionally
truncated to `dimensions` and renormalised (as OpenAI's text-embedding-3 models do)."""
from __future__ import annotations

import base64
from typing import Annotated, Literal, Union

import numpy as np
from fastapi import Depends
from pydantic import BaseModel, Field

from edgellm.errors import ContextOverflowError, InvalidRequestError
from edgellm.server import protocol as P
from edgellm.server.helpers import _check_common, _completion_prompts, _tokenized
from edgellm.server.state import ERROR_RESPONSES, ServerState

EmbeddingInput = Union[Annotated[str, Field(min_length=1)], Annotated[list[str], Field(min_length=1, max_length=2048)],
                       Annotated[list[int], Field(min_length=1)],
                       Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=2048)]]


class EmbeddingRequest(P._Request):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Keep the first n dimensions (renormalised).")
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def embeddings_of(s: ServerState, ids: list[list[int]], dimensions: int | None) -> np.ndarray:
    """(N, D') embeddings of token sequences (D' = dimensions if given), errors as 400s naming the field."""
    d = s.llm.config.d_model
    if dimensions is not None and dimensions > d:
        raise P.APIError(400, f"dimensions must be at most {d} for this model", param="dimensions")
    if any(len(x) == 0 for x in ids):
        raise P.APIError(400, "an input is empty", param="input")
    try:
        vecs = s.llm.embed(ids)
    except (ContextOverflowError, InvalidRequestError) as e:
        code = "context_length_exceeded" if isinstance(e, ContextOverflowError) else None
        raise P.APIError(400, str(e), param="input", code=code) from None
    if dimensions is not None:
        from edgellm.embeddings import normalize

        vecs = normalize(vecs[:, :dimensions])
    return vecs


def register(app, ready, guarded) -> None:
    """Add the route to app."""

    @app.post("/v1/embeddings", dependencies=guarded, response_model=EmbeddingList, responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, s: ServerState = Depends(ready)):
        _check_common(s, body)
        inp = body.input
        if isinstance(inp, list) and inp and isinstance(inp[0], str) and not all(inp):
            raise P.APIError(400, "an input is empty", param="input")
        try:
            ids = await _tokenized(_completion_prompts, s, inp)
        except InvalidRequestError as e:
            raise P.APIError(400, str(e), param="input") from None
        s.reserve(1)
        try:
            vecs = await _tokenized(embeddings_of, s, ids, body.dimensions)
        finally:
            s.release()
        data = []
        for i, v in enumerate(vecs):
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64" \
                else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(x) for x in ids)
        return {"object": "list", "data": data, "model": s.model_id, "usage": {"prompt_tokens": n, "total_tokens": n}}
