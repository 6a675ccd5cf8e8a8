"""OpenAI's Responses API for the jobs service (service.py assembles it): POST /v1/responses on the same models and
sampling as chat completions (api_chat.py). `instructions`, `input` as a string or as items (messages, function
calls and their outputs), function tools through the model's chat template, `max_output_tokens`, streamed as the
Responses API's typed events when asked. Structured outputs (text.format) and forced calls (tool_choice) are
constrained decoding, as in chat. Nothing is stored: a response cannot be retrieved or continued
(`previous_response_id`, `conversation`), and built-in tools (web search, file search, ...) are refused."""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dpokit.service.api_chat import (DEFAULT_MAX_TOKENS, TEMPLATE_HEADER, allowed_names, choices_of, constraint,
                                     forwarded, render)
from dpokit.service.jobs import now
from dpokit.service.service import ApiError, Svc


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list] = None  # an earlier response's output_text, passed back as input


class OtherInput(BaseModel):  # what the SDK also allows in content; refused below, naming its type
    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Annotated[Union[InputText, OtherInput], Field(discriminator="type")]]]
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # other tool types are named in the 400 below
    type: str
    name: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: Optional[TextFormat] = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: Union[str, list[Union[MessageItem, FunctionCallItem, FunctionOutputItem]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1, le=4096)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[Annotated[int, Field(ge=1)]] = None  # the answer's first calls, at most this many
    stream: Optional[bool] = None
    text: Optional[TextOptions] = None
    previous_response_id: Optional[str] = None
    conversation: Union[str, dict, None] = None
    background: Optional[bool] = None
    reasoning: Optional[dict] = None
    include: Optional[list[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    # accepted and recorded nowhere: they do not change what the model generates (store: nothing is kept)
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    service_tier: Optional[str] = None


def refused(body: ResponsesRequest) -> None:
    """A 400 naming the first field this service cannot honour."""
    for name, why in (("previous_response_id", "responses are not stored here: send the whole conversation as input"),
                      ("conversation", "conversations are not stored here: send the whole conversation as input"),
                      ("background", "responses run in the request here, not in the background"),
                      ("reasoning", "the models served here have no reasoning options"),
                      ("include", "there is nothing extra to include from models served here")):
        if getattr(body, name):
            raise ApiError(400, f"{name}: {why}", name)
    for i, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise ApiError(400, f"tools[{i}].type: only function tools (got {tool.type!r}: no built-in tools here)",
                           f"tools[{i}].type")
        if not tool.name:
            raise ApiError(400, f"tools[{i}].name is required", f"tools[{i}].name")


def responses_constraint(body: ResponsesRequest, tools: list[dict] | None):
    """api_chat.constraint() for a Responses request: tool_choice as "none", "auto", "required",
    {"type": "function", "name"} or {"type": "allowed_tools", "mode", "tools"}; text.format as text, json_object or
    {"type": "json_schema", "name", "schema", "strict"}. Built-in tool choices are refused, naming their type."""
    choice, names, parallel = body.tool_choice, None, body.parallel_tool_calls is not False
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            choice, names, parallel = "required", [choice["name"]], False
        elif kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and \
                isinstance(choice.get("tools"), list) and all(isinstance(t, dict) for t in choice["tools"]):
            names = allowed_names(choice["tools"])
            choice = choice["mode"]
        else:
            raise ApiError(400, "tool_choice: 'none', 'auto', 'required', {'type': 'function', 'name': ...} or "
                           f"{{'type': 'allowed_tools', ...}} (got type {kind!r}: function tools only here)",
                           "tool_choice")
    fmt = body.text.format if body.text and body.text.format else None
    answer_format = None
    if fmt is not None and fmt.type == "json_object":
        answer_format = (None, False)
    elif fmt is not None and fmt.type == "json_schema":
        extra = fmt.model_extra or {}
        if not isinstance(extra.get("name"), str) or not isinstance(extra.get("schema"), dict):
            raise ApiError(400, "text.format: json_schema needs a name and a schema object", "text.format")
        answer_format = (extra["schema"], bool(extra.get("strict")))
    elif fmt is not None and fmt.type != "text":
        raise ApiError(400, f"text.format: 'text', 'json_object' or 'json_schema' (got {fmt.type!r})", "text.format")
    return constraint(tools, choice or "auto", names, parallel, answer_format, "text.format")


def text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text"):
            raise ApiError(400, f"{where}[{j}]: only text is read by this service (got type {part.type!r})",
                           f"{where}[{j}].type")
    return "".join(part.text for part in content)


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """instructions and input as chat messages: instructions (and developer) as system, function calls as an
    assistant turn's tool_calls (consecutive calls in one turn), their outputs as tool messages."""
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": text_of(item.content, f"input[{i}].content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and out[-1]["content"] is None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": text_of(item.output, f"input[{i}].output")})
    if not out or all(m["role"] == "system" for m in out):
        raise ApiError(400, "input: nothing to answer (give a string or at least one message)", "input")
    return out


def output_items(choice: dict) -> list[dict]:
    """A sampled answer (api_chat.choices_of) as the Responses API's output: a message with its words, then each
    function call."""
    items = []
    if choice["words"]:
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed",
                      "role": "assistant", "content": [{"type": "output_text", "text": choice["words"],
                                                        "annotations": [], "logprobs": []}]})
    for call in choice["calls"]:
        items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


router = APIRouter(prefix="/v1", tags=["responses"])


@router.post("/responses")
def create_response(svc: Svc, body: ResponsesRequest):
    refused(body)
    messages = chat_messages(body)
    tools = [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                 ("parameters", t.parameters)) if v is not None}}
             for t in body.tools] if body.tools else None
    tools, grammar, calls_parsed, calls_only = responses_constraint(body, tools)
    if (target := svc.engine_target(body.model)) is not None:  # stored nowhere on this path either
        return forwarded(svc, body, "/v1/responses", target, messages, tools, {"store": False})
    model, tokenizer = svc.chat.load(svc, body.model)
    text, template = render(tokenizer, messages, body.model, tools)
    options = {"max_tokens": body.max_output_tokens or DEFAULT_MAX_TOKENS,
               "temperature": 1.0 if body.temperature is None else body.temperature, "top_p": body.top_p or 1.0,
               "seed": None, "n": 1, "grammar": grammar}
    with svc.chat.lock:
        n_input, sampled = svc.chat.sample(model, tokenizer, text, options)
    keep = 1 if body.parallel_tool_calls is False else body.max_tool_calls  # the answer's first calls only
    choice = choices_of(sampled, lambda answer: (answer, False), calls_parsed, options["max_tokens"], keep,
                        calls_only)[0]
    incomplete = choice["finish"] == "length"
    response = {
        "id": f"resp_{secrets.token_hex(16)}", "object": "response", "created_at": now(),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
        "output": output_items(choice), "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": options["temperature"], "top_p": options["top_p"],
        "text": {"format": body.text.format.model_dump() if body.text and body.text.format else {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "truncation": body.truncation or "disabled", "metadata": body.metadata or {}, "user": body.user,
        "usage": {"input_tokens": n_input, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": choice["tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": n_input + choice["tokens"]}}
    headers = {TEMPLATE_HEADER: template} if template else {}  # tools rendered by the kit's template: said
    if not body.stream:
        return JSONResponse(response, headers=headers)
    return StreamingResponse(stream_events(response), media_type="text/event-stream", headers=headers)


def stream_events(response: dict):
    """The Responses API's streamed events for a whole response: created, in progress, each output item added with
    its text or arguments, done, then completed (or incomplete); each numbered in order."""
    seq = iter(range(1 << 30))

    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": next(seq), **fields}) + "\n\n"

    pending = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            words = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index,
                        item=item | {"status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
            yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                        delta=words, logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=words, logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part | {"text": words})
        else:
            yield event("response.output_item.added", output_index=index,
                        item=item | {"status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                response=response)
