"""Wire models for the pooling endpoints: OpenAI's `/v1/embeddings`, the Cohere / Jina `/v1/rerank` that vLLM and
llama.cpp accept, and vLLM's `/v1/score`.

Unknown fields are accepted and ignored (`extra="allow"`), as for chat: SDKs add fields of their own (`user`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[Annotated[int, Field(ge=0)]]
# vLLM's `truncate_prompt_tokens`: keep at most this many tokens of each input (-1: as many as the model takes).
Truncate = Annotated[int | None, Field(None, ge=-1, description="cut each input to this many tokens (-1: the "
                                       "model's limit) instead of refusing a longer one")]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id lists")
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

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Truncate = None
