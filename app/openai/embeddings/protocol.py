"""Wire models for the pooling endpoints: OpenAI's `/v1/embeddings`, the Cohere / Jina `/v1/rerank` that vLLM and
llama.cpp accept, and vLLM's `/v1/score`.

Unknown fields are accepted and ignored (`extra="allow"`), as for chat: SDKs add fields of their own (`user`).

`LIST_BOUNDS` are these routes' own bounds on their top-level lists, which app/body.py applies before parsing in
place of the chat routes' (`MAX_MESSAGES` would refuse one token-id list of 3,000 ids).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's own per-request limits for /v1/embeddings, so that a client batching for OpenAI fits here too; rerank and
# score count both their sides together.
MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000

# strict: a list of digit strings is texts, never ids coerced from them
TokenIds = list[Annotated[int, Field(ge=0, strict=True)]]
# vLLM's `truncate_prompt_tokens`: keep at most the last this many tokens of each input (-1: as many as the model takes).
Truncate = Annotated[int | None, Field(None, ge=-1, description="keep each input's last this many tokens (-1: the "
                                       "model's limit) instead of refusing a longer one")]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    # `input` may be one token-id list as long as a request's whole token budget (cut by truncate_prompt_tokens);
    # a list of inputs is held to MAX_INPUTS once parsed (app/openai/embeddings/serving.py)
    LIST_BOUNDS: ClassVar[dict[str, tuple[int, str]]] = {"input": (MAX_TOTAL_TOKENS, "MAX_TOTAL_TOKENS")}

    model: str | None = None
    # ids first, left to right: validating 300,000 ids took ~90 ms of GIL in the smart union, which tries every
    # member; ~25 ms this way
    input: TokenIds | list[TokenIds] | str | list[str] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id lists",
        union_mode="left_to_right")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    truncate_prompt_tokens: Truncate = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: a bare string or a bare token-id list is one input."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(item, int) for item in self.input):
            return [list(self.input)]
        return list(self.input)


class Document(BaseModel):
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    LIST_BOUNDS: ClassVar[dict[str, tuple[int, str]]] = {"documents": (MAX_INPUTS, "MAX_INPUTS")}

    model: str | None = None
    query: str
    documents: list[str | Document]
    top_n: int | None = Field(None, ge=0, description="return the best this many (0 or absent: all)")
    return_documents: bool = True
    truncate_prompt_tokens: Truncate = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    LIST_BOUNDS: ClassVar[dict[str, tuple[int, str]]] = {"text_1": (MAX_INPUTS, "MAX_INPUTS"),
                                                         "text_2": (MAX_INPUTS, "MAX_INPUTS")}

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Truncate = None
