"""Request bodies of the OpenAI API (and vLLM's pooling, score and rerank endpoints) as
jaxllm accepts them (pydantic models), and their translation into SamplingParams or
PoolingParams.

Unknown fields are rejected (400 naming the field) rather than silently ignored: a
client asking for something jaxllm does not do (tools, ...) learns it at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxllm.entrypoints.openai import tools
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # outputs always follow the schema


class ResponseFormat(BaseModel):
    """OpenAI's response_format (and vLLM's structural_tag form)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None  # structural_tag
    triggers: list[str] | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return StructuredOutputsParams(structural_tag={"structures": self.structures or [],
                                                       "triggers": self.triggers or []})


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs request field."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                       choice=self.choice, grammar=self.grammar, structural_tag=self.structural_tag,
                                       disable_any_whitespace=self.disable_any_whitespace)


class _SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI's and vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefix-cache blocks shared only within one salt
    priority: int = 0  # vLLM's: lower first under --scheduling-policy priority
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: all that fit)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    # beam search (vLLM's extras): n is the beam width; the n best sequences come back,
    # best first (a stream sends them when the search ends)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or its
    # older guided_* fields (one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _constraint(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field gives it."""
        given = {name: getattr(self, name) for name in ("response_format", "structured_outputs", "guided_json",
                                                         "guided_regex", "guided_choice", "guided_grammar")}
        if given["response_format"] is not None and given["response_format"].type == "text":
            given["response_format"] = None
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise ValueError(f"{list(given)[1]}: give one output constraint, not {' and '.join(given)}")
        if not given:
            return None
        (name, value), = given.items()
        if name in ("response_format", "structured_outputs"):
            return value.constraint()
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams of the request's fields; `constraint` (a forced tool call's)
        in place of the structured-output fields'."""
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys must be token ids") from None
        default_temperature = 0.0 if self.use_beam_search else 1.0  # beam search does not sample
        return SamplingParams(
            n=self.n,
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=constraint or self._constraint(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        return list(p)

    @property
    def echo_logprobs(self) -> bool:
        """Whether the echoed prompt comes with logprobs (echo and logprobs both set)."""
        return self.echo and self.logprobs is not None

    def to_sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is only meaningful with echo=true, to return "
                             "the prompt (with logprobs: its log-probabilities) without generating")
        # echo with logprobs returns the prompt's logprobs too, with as many alternatives;
        # with max_tokens 0 the engine scores the prompt whatever the response shows of it
        prompt_logprobs = self.prompt_logprobs
        if self.echo_logprobs:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        elif self.max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


def text_parts(parts: list[Any]) -> list[TextPart | ImagePart]:
    """A message's content parts: text parts, joined later, and images (`image_url`:
    read by a vision-language model, refused by a text-only one when the prompt is
    made); any other type (audio, a file) is refused by name."""
    out = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image_url"):
            raise ValueError(f"part {i}: a content part of type {kind!r} is not supported: this server reads text "
                             "and image_url parts")
        out.append((TextPart if kind == "text" else ImagePart).model_validate(part))
    return out


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text


class ToolCallMessage(BaseModel):
    """A tool call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: Any) -> Any:
        return text_parts(content) if isinstance(content, list) else content


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # forced calls always follow the schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (enable_thinking, ...)
    chat_template: str | None = None  # vLLM's: this request's Jinja template in place of the model's
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not closed
    include_reasoning: bool = True  # with a reasoning parser: return the thinking
    echo: bool = False  # vLLM's: the answer starts with the last message's content, when that is the assistant's

    def echoed(self) -> str:
        """What the answer starts with (echo): the last message's text if it is the
        assistant's, as vLLM does; else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        return last.content if isinstance(last.content, str) else "".join(p.text for p in last.content)

    def render_options(self) -> dict:
        """How the conversation is rendered: ValueError for vLLM's refused combination."""
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt true (the "
                             "last message is continued, no new one opened)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return {"chat_template": self.chat_template, "continue_final_message": self.continue_final_message,
                "add_generation_prompt": self.add_generation_prompt and not self.continue_final_message}

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     self.prompt_logprobs, self._tool_constraint())

    def resolved_tool_choice(self) -> str | dict:
        """"none", "auto", "required" or {"type": "function", "function": {"name"}}, with
        OpenAI's default (auto with tools, none without); ValueError if it names no tool."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise ValueError(f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} "
                             "needs tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
            return choice.model_dump()
        return choice

    def tool_dicts(self) -> list[dict] | None:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def _tool_constraint(self) -> StructuredOutputsParams | None:
        """A required or named tool call's output constraint (the tools' schemas). A
        response_format beside it formats text answers, which such a turn has none of
        (agent frameworks send both); a grammar of structured_outputs is refused."""
        choice = self.resolved_tool_choice()
        constraint = tools.constraint(self.tool_dicts() or [], choice, self.parallel_tool_calls)
        if constraint is None:
            return None
        if self.response_format is None and self._constraint() is not None:
            raise ValueError("tool_choice: a required or named tool call cannot be combined with "
                             "structured_outputs")
        try:
            constraint.check()
        except ValueError as e:
            raise ValueError(f"tools: a function's parameters are not a usable JSON schema ({e})") from None
        return constraint

    def message_dicts(self) -> list[dict]:
        return [tools.history_message(m.model_dump(exclude_none=True)) for m in self.messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: reload an adapter already loaded under this name


class UpdateWeightsRequest(BaseModel):
    """POST /update_weights (development mode): an HF folder (or GGUF) of the served model."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ------------------------------------------------------------------ pooling

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class _PoolingFields(BaseModel):
    """What the pooling endpoints share (OpenAI's embeddings fields, vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: EmbeddingInput
    encoding_format: str = "float"  # "float" or "base64" (little-endian float32s); checked by the handler
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or token ids (OpenAI's four forms of `input`); 400s for
        an empty list, an empty string or an empty token list, as OpenAI answers them."""
        value = self.input
        if isinstance(value, str):
            items: list = [value]
        elif not value:
            raise ValueError("input: must not be empty")
        elif all(isinstance(v, int) for v in value):
            items = [list(value)]
        else:
            items = list(value)
        for i, item in enumerate(items):
            if not item:
                raise ValueError(f"input: item {i} is empty (an empty string or token list cannot be embedded)")
        return items

    def pooling_params(self, task: str) -> PoolingParams:
        return PoolingParams(task=task, dimensions=self.dimensions, truncate_prompt_tokens=self.truncate_prompt_tokens)


class EmbeddingRequest(_PoolingFields):
    """OpenAI's POST /v1/embeddings (with vLLM's truncate_prompt_tokens and
    add_special_tokens)."""

    normalize: bool | None = None  # vLLM's: the model's pooler by default

    def pooling_params(self, task: str = "embed") -> PoolingParams:
        return dataclasses.replace(super().pooling_params(task), normalize=self.normalize)


class PoolingRequest(EmbeddingRequest):
    """vLLM's POST /pooling: the pooler's output, by default as LLM.encode gives it
    (not normalized); `task` "embed" (the embedding) or "token_embed" (one per token)."""

    task: str = "encode"


class ScoreRequest(BaseModel):
    """vLLM's POST /score (and /v1/score): text_1 against each of text_2, or pairwise."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankRequest(BaseModel):
    """POST /rerank, /v1/rerank (Jina's shape), /v2/rerank (Cohere's): the documents
    by their relevance to the query, best first."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    max_tokens_per_doc: int | None = None  # Cohere v2's: taken as truncate_prompt_tokens for the documents
    user: str | None = None
