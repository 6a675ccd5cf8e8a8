"""OpenAI's models and chat completions for the jobs service (service.py assembles it): a base or a fine-tuned
model loaded as `make chat` loads it, kept warm (--warm_models), one generation at a time; streamed as
server-sent events when asked; n answers in one batch, with their tokens' log-probabilities when asked. Tools go through the model's chat template (a run trained with --chat_template
chatml-tools carries one that renders them) and the answer's <tool_call> blocks come back as OpenAI tool calls.
Text parts only: another content part, or a field the kit cannot honour, is a 400 naming it."""

from __future__ import annotations

import json
import re
import secrets
import threading
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dpokit.core import runs
from dpokit.model import constrain, models
from dpokit.service.jobs import new_id, now
from dpokit.service.service import ApiError, Svc, parse_model_map

GREEDY_BELOW = 1e-4  # a chat temperature under this samples greedily (see Models.generate)
MAX_CHOICES = 8  # n: answers sampled together, one batch
DEFAULT_MAX_TOKENS = 1024  # an answer's tokens when the request sets no limit (OpenAI's: the model's context)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):  # what the SDK also allows in content; refused below, naming its type
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, refusal, audio: the SDK's params
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Union[str, list[Annotated[Union[TextPart, OtherPart], Field(discriminator="type")]], None] = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")  # none: any JSON object
    strict: Optional[bool] = None


class FormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class FormatJSONObject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class FormatJSONSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


class ChosenName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedChoice(BaseModel):  # {"type": "function", "function": {"name": ...}}: that function, called
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenName


class CustomChoice(BaseModel):  # a custom tool, refused (this service has function tools only)
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"]
    custom: ChosenName


class AllowedTools(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "required"]
    tools: list[dict]


class AllowedChoice(BaseModel):  # only these tools: called if mode is required, offered if auto
    model_config = ConfigDict(extra="forbid")
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Optional[bool] = None  # a last chunk with no choices and the request's usage
    include_obfuscation: Optional[bool] = None  # random padding in each chunk (OpenAI's default: on)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[Annotated[int, Field(ge=1, le=4096)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=4096)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    seed: Optional[Annotated[int, Field(ge=-2 ** 63, lt=2 ** 64)]] = None  # torch.manual_seed's range
    n: Optional[Annotated[int, Field(ge=1, le=MAX_CHOICES)]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None  # OpenAI's range
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    tools: Optional[list[ChatTool]] = None  # rendered by the model's chat template; calls parsed from <tool_call>
    tool_choice: Union[Literal["none", "auto", "required"], Annotated[Union[NamedChoice, CustomChoice, AllowedChoice],
                                                                      Field(discriminator="type")], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Annotated[Union[FormatText, FormatJSONObject, FormatJSONSchema],
                                        Field(discriminator="type")]] = None  # constrained decoding (constrain.py)
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None  # 0 only (refused otherwise, below)
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    modalities: Optional[list[Literal["text", "audio"]]] = None  # text only
    # accepted and recorded nowhere: they do not change what the model generates
    prompt_cache_retention: Optional[str] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[str] = None


def plain_messages(messages: list[Message]) -> list[dict]:
    """The request's messages as a chat template takes them: developer -> system, text parts joined, tool calls
    and tool results kept; a non-text part is refused naming it."""
    out = []
    for i, m in enumerate(messages):
        content, extra = m.content, m.model_extra or {}
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are read by this service "
                                   f"(got type {part.type!r})", f"messages[{i}].content[{j}].type")
            content = "".join(part.text for part in content)
        if content is None and not (m.role == "assistant" and extra.get("tool_calls")):
            raise ApiError(400, f"messages[{i}].content is required (only an assistant message with tool_calls "
                           "may have none)", f"messages[{i}].content")
        msg = {"role": {"developer": "system", "function": "tool"}.get(m.role, m.role), "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if extra.get(key) is not None:
                msg[key] = extra[key]
        out.append(msg)
    return out


def prepared(tokenizer, model, text: str, options: dict) -> tuple:
    """(the tokenised prompt on the model's device, generate's sampling arguments); torch seeded when asked. Below
    GREEDY_BELOW the sampled distribution is the greedy one to float precision, and dividing the logits by the
    temperature overflows them to inf (a 500 once, at temperature 1e-300): greedy there."""
    import torch

    batch = tokenizer([text], return_tensors="pt", add_special_tokens=not tokenizer.chat_template).to(model.device)
    if options.get("seed") is not None:
        torch.manual_seed(options["seed"])
    temperature = options.get("temperature", 1.0)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": options.get("top_p", 1.0)} \
        if temperature and temperature >= GREEDY_BELOW else {"do_sample": False}
    if options.get("grammar"):  # structured output or a forced call: each step masked to what the grammar allows
        sampling["logits_processor"] = [constrain.GrammarProcessor(options["grammar"], tokenizer,
                                                                   sorted(end_ids(model, tokenizer)))]
    return batch, sampling


def end_ids(model, tokenizer) -> set[int]:
    """The tokens that end an answer: the model's generation config's, and the tokenizer's end of text."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return ({*eos} if isinstance(eos, list) else {eos} if eos is not None else set()) | {tokenizer.eos_token_id}


class Chat:
    """Models loaded on first use (torch is imported only then), the least recently used dropped beyond
    --warm_models."""

    def __init__(self, cfg):
        self.cfg, self.loaded, self.lock = cfg, {}, threading.Lock()

    def model(self, name: str, run_dir: Path | None, base: str):
        if name in self.loaded:
            self.loaded[name] = self.loaded.pop(name)  # most recently used last
            return self.loaded[name]
        models.quiet_libraries(terminal=False)  # no weight-loading bars in the service's log
        if run_dir is not None:
            run_dir, config = runs.open_run(run_dir, run_dir.parent)
            pair = models.load_run(run_dir, config)
        else:
            from transformers import AutoTokenizer

            on_gpu, bf16_ok = models.device()
            path = models.resolve_model_path(base)
            model = models.load_model(path, models.LoadOptions(), on_gpu, bf16_ok).eval()
            if not on_gpu:
                models.dequantize_4bit_(model)
            pair = (model, AutoTokenizer.from_pretrained(path))
        while len(self.loaded) >= self.cfg.warm_models:
            self.loaded.pop(next(iter(self.loaded)))
        self.loaded[name] = pair
        return pair

    def generate(self, model, tokenizer, text: str, options: dict, streamer=None) -> tuple[str, int, int]:
        """(answer, prompt tokens, completion tokens): greedy at temperature 0, else sampled (seeded when asked)."""
        import torch

        batch, sampling = prepared(tokenizer, model, text, options)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=options["max_tokens"], streamer=streamer,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
        completion = out[0, batch["input_ids"].shape[1]:]
        answer = tokenizer.decode(completion, skip_special_tokens=True).strip()
        return answer, int(batch["input_ids"].shape[1]), int(completion.shape[0])

    def sample(self, model, tokenizer, text: str, options: dict, raw: bool = False) -> tuple[int, list[dict]]:
        """(prompt tokens, n choices), all sampled in one batch: each {"text", "tokens" (ids, its end token
        included), "logprobs" (with options["logprobs"]: each token's log-probability under the model's own
        distribution, and its top_logprobs alternatives, OpenAI's shape), "ended" (its end token drawn, not cut at
        max_tokens)}. raw: the text is not a chat template's
        (legacy completions): the answer keeps its leading space."""
        import torch

        batch, sampling = prepared(tokenizer, model, text, options)
        n = options.get("n", 1)
        ends = end_ids(model, tokenizer)
        drawn = n if sampling["do_sample"] else 1  # greedy answers are all the same: one, given n times
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=options["max_tokens"], num_return_sequences=drawn,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                 return_dict_in_generate=True, output_logits=bool(options.get("logprobs")), **sampling)
        start, choices = batch["input_ids"].shape[1], []
        for i in (j % drawn for j in range(n)):
            ids = out.sequences[i, start:].tolist()
            length = next((k + 1 for k, t in enumerate(ids) if t in ends), len(ids))
            ids = ids[:length]
            answer = tokenizer.decode(ids, skip_special_tokens=True)
            choice = {"text": answer if raw else answer.strip(), "tokens": ids, "logprobs": None,
                      "ended": bool(ids) and ids[-1] in ends}
            if options.get("logprobs"):  # the answer's tokens, not the end token that closed it (as OpenAI's)
                shown = ids[:-1] if ids and ids[-1] in ends else ids
                steps = torch.stack([out.logits[k][i] for k in range(len(shown))]).float().log_softmax(-1) \
                    if shown else None
                choice["logprobs"] = token_logprobs(tokenizer, shown, steps, options.get("top_logprobs") or 0)
            choices.append(choice)
        return int(start), choices

    def load(self, svc, name: str):
        """(model, tokenizer) for a model name the service knows: a succeeded job's, an adapter loaded at run time
        (--runtime_lora) or a base; 404 otherwise."""
        job, adapter = svc.tuned_job(name), svc.adapters.get(name)
        run_dir = svc.out / job["id"] if job else adapter[0] if adapter else None
        base = job["base"] if job else adapter[1] if adapter else svc.base_path(name)
        if base is None:
            raise ApiError(404, f"model {name!r} does not exist here (GET /v1/models lists them)", "model",
                           "model_not_found")
        with self.lock:  # loading is slow: one at a time, and each model once
            return self.model(name, run_dir, base)


TEMPLATE_HEADER = "x-dpo-kit-chat-template"  # set when tool use was rendered with the kit's template, not the model's


def render(tokenizer, messages: list[dict], name: str, tools: list | None = None) -> tuple[str, str | None]:
    """(the prompt text, the name of the kit's template used instead of the model's, or None). The model's chat
    template renders the request (with its tools); where it leaves tool use out and it is ChatML (SmolLM2's), the
    kit's chatml-tools template does, as training on tool use does (--chat_template chatml-tools). A conversation
    no template can render is the client's 400, not the service's 500."""
    template = None
    if tools or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        problem = models.tool_template_problem(tokenizer)
        if problem and "<|im_start|>" in (tokenizer.chat_template or ""):
            template = "chatml-tools"
        elif problem:
            raise ApiError(400, f"model {name!r} cannot take tool use: {problem} (a run trained with a template "
                           "that renders tools, --chat_template FILE.jinja, can)", "tools" if tools else "messages")
    try:
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                 chat_template=models.chat_template_text(template or "")), template
        return models.prompt_texts(tokenizer, [messages])[0], template
    except Exception as e:  # noqa: BLE001 - jinja's errors, a None content concatenated, ...
        raise ApiError(400, f"messages: model {name!r}'s chat template cannot render them "
                       f"({type(e).__name__}: {str(e)[:200]})", "messages") from None


def token_logprobs(tokenizer, ids: list[int], steps, top: int) -> list[dict]:
    """OpenAI's logprobs.content: each generated token, its log-probability, its UTF-8 bytes and the `top` most
    likely tokens at its step (steps: [tokens, vocab] log-probabilities, as the model gave them before sampling)."""
    def entry(token_id: int, logprob: float) -> dict:
        piece = tokenizer.decode([token_id])
        return {"token": piece, "logprob": max(logprob, -9999.0), "bytes": list(piece.encode("utf-8"))}

    out = []
    for k, token_id in enumerate(ids):
        item = entry(token_id, float(steps[k, token_id]))
        values, indices = steps[k].topk(top) if top else ((), ())
        item["top_logprobs"] = [entry(int(j), float(v)) for v, j in zip(values, indices)]
        out.append(item)
    return out


def choices_of(sampled: list[dict], cut, calls_parsed: bool, max_tokens: int, max_calls: int | None = None,
               calls_only: bool = False) -> list[dict]:
    """Each sampled answer (Chat.sample) as a choice: cut at the first stop string (its logprobs to the tokens
    kept), its tool calls parsed when the request has tools (the first max_calls of them), its finish reason:
    "length" when max_tokens cut it, whatever it holds, else "tool_calls" or "stop". calls_only: the answer was held
    to tool calls (a forced call), so what is left beside them (a call cut short) is not words."""
    out = []
    for i, s in enumerate(sampled):
        answer, stopped = cut(s["text"])
        words, calls = tool_calls_in(answer) if calls_parsed else (answer, [])
        calls = calls[:max_calls] if max_calls else calls
        words = None if calls_only else words
        logprobs = None
        if s["logprobs"] is not None:
            kept, shown = [], ""
            for item in s["logprobs"]:
                if stopped and len((shown + item["token"]).strip()) > len(answer):
                    break
                shown += item["token"]
                kept.append(item)
            logprobs = {"content": kept, "refusal": None}
        cut_short = not stopped and not s.get("ended", len(s["tokens"]) < max_tokens) and len(s["tokens"]) >= max_tokens
        finish = "length" if cut_short else "tool_calls" if calls else "stop"
        out.append({"index": i, "words": words, "calls": calls, "finish": finish, "logprobs": logprobs,
                    "tokens": len(s["tokens"])})
    return out


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_calls_in(answer: str) -> tuple[str | None, list[dict]]:
    """(the words, the calls) of an answer that calls tools as the kit's chatml-tools template (and Hermes-style
    templates) teach: each <tool_call>{"name", "arguments"}</tool_call> that parses becomes an OpenAI tool call
    (arguments as a JSON string); one that does not stays in the words."""
    calls, kept = [], []
    for match in TOOL_CALL.finditer(answer):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]:
            args = call.get("arguments", {})
            calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {
                "name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
            kept.append(match.span())
    words = answer
    for start, end in reversed(kept):
        words = words[:start] + words[end:]
    words = words.strip()
    return (words or None) if calls else answer, calls


# ---------------------------------------------------------------------------------------------
# The routes: /v1/models and /v1/chat/completions, each given the service by FastAPI's Depends (its Chat: svc.chat,
# made by serve.create_app).
# ---------------------------------------------------------------------------------------------

router = APIRouter(prefix="/v1", tags=["models and chat"])


@router.get("/models")
def list_models(svc: Svc):
    names = [*svc.base_models(), *(n for n, _ in parse_model_map(getattr(svc.cfg, "model_map", ""))
                                   if not n.endswith("*") and svc.base_path(n))]  # a pattern is not a model
    bases = [{"object": "model", "id": name, "created": 0, "owned_by": "dpo-kit"} for name in dict.fromkeys(names)]
    tuned = [{"object": "model", "id": j["fine_tuned_model"], "created": j["finished_at"], "owned_by": "user"}
             for j in svc.store.query("SELECT * FROM jobs WHERE status = 'succeeded' AND model_deleted IS NULL "
                                      "ORDER BY seq")]
    loaded = [{"object": "model", "id": name, "created": 0, "owned_by": "user"} for name in list(svc.adapters)]
    return {"object": "list", "data": bases + tuned + loaded}


def constraint(tools: list[dict] | None, mode: str, names: list[str] | None, parallel: bool,
               answer_format: tuple | None, format_param: str) -> tuple[list[dict] | None, str | None, bool, bool]:
    """(the tools the chat template renders, the grammar the answer is held to or None, whether the answer's tool
    calls are read, whether it is held to calls only), from a request's tools, its tool choice (mode "none", "auto"
    or "required"; names: the tools it narrows to, a named function or allowed_tools) and its answer format ((schema
    or None, strict) for JSON, None for text). Forced calls and JSON are constrained decoding (constrain.py); with
    tools offered and a JSON format, the answer is either calls or the JSON. A tool choice naming no tool of the
    request, or a schema the grammar library cannot enforce, is a 400 naming it."""
    if names is not None:
        offered = [t["function"]["name"] for t in tools or ()]
        unknown = [name for name in names if name not in offered]
        if unknown:
            raise ApiError(400, f"tool_choice: no function named {unknown[0]!r} in tools", "tool_choice")
        tools = [t for t in tools or () if t["function"]["name"] in names] or None  # allowed_tools may list none
    if mode == "required" and not tools:
        raise ApiError(400, "tool_choice: 'required' needs tools to call", "tool_choice")
    calls_parsed = bool(tools) and mode != "none"
    if mode != "required" and answer_format is None:
        return tools, None, calls_parsed, False
    functions = [t["function"] for t in tools] if calls_parsed else []
    try:
        grammar = constrain.grammar(*(answer_format or (None, False)), json_answer=answer_format is not None,
                                    functions=functions, calls_only=mode == "required", parallel=parallel)
    except RecursionError:
        raise ApiError(400, f"{format_param}: nested too deeply", format_param) from None
    except ValueError as e:
        param = "tools" if str(e).startswith("function ") else format_param
        raise ApiError(400, f"{param}: {e}", param) from None
    return tools, grammar, calls_parsed, mode == "required"


def allowed_names(tools: list[dict]) -> list:
    """The function names an allowed_tools list gives, chat's shape ({"function": {"name"}}) or Responses' ({"name"});
    an entry with no name string gives None, which no tool is called (so the request is a 400 naming tool_choice)."""
    names = []
    for tool in tools:
        inner = tool.get("function")
        name = inner.get("name") if isinstance(inner, dict) else tool.get("name")
        names.append(name if isinstance(name, str) else None)
    return names


def chat_constraint(body: ChatRequest, tools: list[dict] | None):
    """constraint() for a chat request: its tool_choice and response_format in chat completions' shapes."""
    choice, names = body.tool_choice, None
    if isinstance(choice, CustomChoice):
        raise ApiError(400, "tool_choice: custom tools are not served here (function tools only)", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedChoice):  # that function, called once
        choice, names, parallel = "required", [choice.function.name], False
    elif isinstance(choice, AllowedChoice):
        names = allowed_names(choice.allowed_tools.tools)
        choice = choice.allowed_tools.mode
    fmt = body.response_format
    answer_format = (None, False) if isinstance(fmt, FormatJSONObject) else \
        (fmt.json_schema.schema_, bool(fmt.json_schema.strict)) if isinstance(fmt, FormatJSONSchema) else None
    return constraint(tools, choice or "auto", names, parallel, answer_format,
                      "response_format.json_schema.schema" if isinstance(fmt, FormatJSONSchema) else "response_format")


def no_penalties(body) -> None:
    """Frequency and presence penalties: 0 (OpenAI's default) is what this service samples with; others a 400."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: only 0 (this service samples without penalties)", name)


def checked_chat(body: ChatRequest) -> tuple[list[dict], list[dict] | None, str | None, bool, bool]:
    """Every refusal a chat request gets before a model is read, on either path: (its messages as a template takes
    them, its tools, the grammar its answer is held to, whether tool calls are read, whether only calls are)."""
    no_penalties(body)
    if body.modalities and set(body.modalities) != {"text"}:
        raise ApiError(400, "modalities: only ['text'] (the models served here write text)", "modalities")
    if (body.stream_options and body.stream_options.model_fields_set) and not body.stream:
        raise ApiError(400, "stream_options: only with stream=true", "stream_options")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: only with logprobs=true", "top_logprobs")
    messages = plain_messages(body.messages)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    return messages, *chat_constraint(body, tools)


def forwarded(svc, body: BaseModel, path: str, target: str, messages: list[dict] | None = None, tools=None,
              extra: dict | None = None):
    """A validated request answered by the serving engine (engine.py) as model `target`: rendered here first with
    the base's tokenizer, so a conversation the kit's path refuses is refused the same, and its template said the
    same (the engine renders with it: engine.vllm_command); the body as the client set it, extra on top."""
    template = render(svc.engine.tokenizer(), messages, body.model, tools)[1] if messages is not None else None
    headers = {TEMPLATE_HEADER: template} if template else {}
    fields = {"system_fingerprint": f"dpo-kit:{template}"} if template and path.endswith("/chat/completions") else {}
    payload = body.model_dump(exclude_unset=True, by_alias=True) | {"model": target} | (extra or {})
    return svc.engine.forward(path, payload, body.model, headers, fields)


@router.post("/chat/completions")
def chat_completions(svc: Svc, body: ChatRequest, response: Response):
    messages, tools, grammar, calls_parsed, calls_only = checked_chat(body)
    if (target := svc.engine_target(body.model)) is not None:
        return forwarded(svc, body, "/v1/chat/completions", target, messages, tools)
    one_call = 1 if body.parallel_tool_calls is False else None  # parallel_tool_calls false: the first call only
    model, tokenizer = svc.chat.load(svc, body.model)
    text, template = render(tokenizer, messages, body.model, tools)
    headers = {TEMPLATE_HEADER: template} if template else {}
    if template:  # the response says which template rendered the tools, in its body too
        response.headers[TEMPLATE_HEADER] = template
    options = {"max_tokens": body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
               "temperature": 1.0 if body.temperature is None else body.temperature,
               "top_p": body.top_p or 1.0, "seed": body.seed, "grammar": grammar}
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    completion_id, created = new_id("chatcmpl"), now()

    def cut(answer: str) -> tuple[str, bool]:
        hits = [answer.index(s) for s in stops if s and s in answer]
        return (answer[:min(hits)], True) if hits else (answer, False)

    stream_options = body.stream_options or StreamOptions()

    def chunk(delta: dict | None, finish=None, usage: tuple | None = None, index: int = 0, logprobs=None) -> str:
        """One server-sent event; delta None: the usage chunk (no choices) that include_usage asks for last."""
        event = {"object": "chat.completion.chunk", "id": completion_id, "created": created, "model": body.model,
                 "choices": [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish}
                                                      | ({"logprobs": logprobs} if logprobs else {})]}
        if stream_options.include_usage:  # null on every chunk but the last, as OpenAI sends them
            event["usage"] = None if usage is None else {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                                         "total_tokens": usage[0] + usage[1]}
        if stream_options.include_obfuscation:  # random characters that vary each event's length
            event["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(24) + 1)
        return "data: " + json.dumps(event) + "\n\n"

    n = body.n or 1
    options |= {"n": n, "logprobs": bool(body.logprobs), "top_logprobs": body.top_logprobs}

    if body.stream and (calls_parsed or n > 1 or body.logprobs):  # whole answers first, then sent in pieces
        def whole():
            with svc.chat.lock:
                n_prompt, sampled = svc.chat.sample(model, tokenizer, text, options)
            choices = choices_of(sampled, cut, calls_parsed, options["max_tokens"], one_call, calls_only)
            for c in choices:
                yield chunk({"role": "assistant", "content": ""}, index=c["index"])
                if c["words"]:
                    yield chunk({"content": c["words"]}, index=c["index"], logprobs=c["logprobs"])
                if c["calls"]:
                    yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(c["calls"])]},
                                index=c["index"])
                yield chunk({}, c["finish"], index=c["index"])
            if stream_options.include_usage:
                yield chunk(None, usage=(n_prompt, sum(c["tokens"] for c in choices)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(whole(), media_type="text/event-stream", headers=headers)
    if body.stream:
        from transformers import TextIteratorStreamer

        def events():
            with svc.chat.lock:
                streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
                result = {}
                worker = threading.Thread(target=lambda: result.update(zip(
                    ("text", "prompt", "completion"), svc.chat.generate(model, tokenizer, text, options, streamer))))
                worker.start()
                yield chunk({"role": "assistant", "content": ""})
                sent, stopped = "", False
                for piece in streamer:
                    if stopped:
                        continue
                    shown, stopped = cut(sent + piece)
                    if shown[len(sent):]:
                        yield chunk({"content": shown[len(sent):]})
                    sent = shown
                worker.join()
            finish = "stop" if stopped or result.get("completion", 0) < options["max_tokens"] else "length"
            yield chunk({}, finish)
            if stream_options.include_usage:
                yield chunk(None, usage=(result.get("prompt", 0), result.get("completion", 0)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    with svc.chat.lock:
        n_prompt, sampled = svc.chat.sample(model, tokenizer, text, options)
    choices = choices_of(sampled, cut, calls_parsed, options["max_tokens"], one_call, calls_only)
    n_completion = sum(c["tokens"] for c in choices)
    return {"object": "chat.completion", "id": completion_id, "created": created, "model": body.model,
            "system_fingerprint": f"dpo-kit:{template}" if template else None, "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["words"]} | (
                {"tool_calls": c["calls"]} if c["calls"] else {}), "finish_reason": c["finish"],
                "logprobs": c["logprobs"]} for c in choices],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                      "total_tokens": n_prompt + n_completion}}


# ---------------------------------------------------------------------------------------------
# Legacy completions (/v1/completions): the prompt as raw text, no chat template; the same sampling as chat.
# ---------------------------------------------------------------------------------------------


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: Union[str, list[str]] = Field(min_length=1)  # token-id prompts are refused by the type: text only
    max_tokens: Optional[Annotated[int, Field(ge=1, le=4096)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    n: Optional[Annotated[int, Field(ge=1, le=MAX_CHOICES)]] = None
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_CHOICES)]] = None
    seed: Optional[Annotated[int, Field(ge=-2 ** 63, lt=2 ** 64)]] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Annotated[int, Field(ge=0, le=5)]] = None  # OpenAI's range for this endpoint
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    logit_bias: Optional[dict[str, int]] = None
    user: Optional[str] = None


def legacy_logprobs(items: list[dict], start: int) -> dict:
    """Chat-shaped token log-probabilities in the legacy completions' shape: tokens, token_logprobs, top_logprobs
    ({token: logprob}) and each token's offset in the returned text (from `start`, the echoed prompt's length)."""
    offsets, at = [], start
    for item in items:
        offsets.append(at)
        at += len(item["token"])
    return {"tokens": [i["token"] for i in items], "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [{t["token"]: t["logprob"] for t in i["top_logprobs"]} for i in items],
            "text_offset": offsets}


@router.post("/completions")
def completions(svc: Svc, body: CompletionRequest):
    no_penalties(body)
    if body.logit_bias:
        raise ApiError(400, "logit_bias: not supported by this service", "logit_bias")
    if body.suffix:
        raise ApiError(400, "suffix: not supported (no fill-in-the-middle)", "suffix")
    n = body.n or 1
    if body.best_of not in (None, n):
        raise ApiError(400, "best_of: only equal to n (this service returns every answer it samples)", "best_of")
    stream_options = body.stream_options or StreamOptions()
    if stream_options.model_fields_set and not body.stream:
        raise ApiError(400, "stream_options: only with stream=true", "stream_options")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not all(prompts):
        raise ApiError(400, "prompt: each prompt must be non-empty text", "prompt")
    if (target := svc.engine_target(body.model)) is not None:
        return forwarded(svc, body, "/v1/completions", target)
    model, tokenizer = svc.chat.load(svc, body.model)
    options = {"max_tokens": body.max_tokens or 16,
               "temperature": 1.0 if body.temperature is None else body.temperature, "top_p": body.top_p or 1.0, "seed": body.seed, "n": n, "logprobs": body.logprobs is not None,
               "top_logprobs": body.logprobs or 0}  # OpenAI's default max_tokens here is 16
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []

    def cut(answer: str) -> tuple[str, bool]:
        hits = [answer.index(s) for s in stops if s and s in answer]
        return (answer[:min(hits)], True) if hits else (answer, False)

    choices, n_prompt, n_completion = [], 0, 0
    with svc.chat.lock:
        for prompt in prompts:  # OpenAI's order: every choice of the first prompt, then the second's, ...
            prompt_tokens, sampled = svc.chat.sample(model, tokenizer, prompt, options, raw=True)
            n_prompt += prompt_tokens
            for c in choices_of(sampled, cut, False, options["max_tokens"]):
                shown = (prompt if body.echo else "") + (c["words"] or "")
                logprobs = legacy_logprobs(c["logprobs"]["content"], len(prompt) if body.echo else 0) \
                    if c["logprobs"] is not None else None
                choices.append({"text": shown, "index": len(choices), "logprobs": logprobs,
                                "finish_reason": c["finish"]})
                n_completion += c["tokens"]
    completion_id, created = new_id("cmpl"), now()
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
    if not body.stream:
        return {"object": "text_completion", "id": completion_id, "created": created, "model": body.model,
                "choices": choices, "usage": usage}

    def event(choice_list: list, with_usage=None) -> str:
        event = {"object": "text_completion", "id": completion_id, "created": created, "model": body.model,
                 "choices": choice_list}
        if stream_options.include_usage:
            event["usage"] = with_usage
        if stream_options.include_obfuscation:
            event["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(24) + 1)
        return "data: " + json.dumps(event) + "\n\n"

    def events():  # each whole answer as it is done, then its finish
        for c in choices:
            yield event([c | {"finish_reason": None}])
            yield event([{"text": "", "index": c["index"], "logprobs": None, "finish_reason": c["finish_reason"]}])
        if stream_options.include_usage:
            yield event([], usage)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
