"""Chat messages / raw prompts -> token ids, with the checks every protocol makes on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from starlette.concurrency import run_in_threadpool

from cobatch.chat_template import RESERVED_VARIABLES, ChatTemplate, ChatTemplateError
from cobatch.engine.grammar import (forced_tool_call_grammar, json_grammar, schema_from_response_format,
                                    structured_grammar)
from cobatch.errors import UserError
from cobatch.llm import LLM
from cobatch.server.errors import ApiError, bad_request

if TYPE_CHECKING:
    from cobatch.server.context import ServerContext


def render_chat(llm: LLM, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None, continue_final: bool = False,
                param: str = "messages") -> tuple[list[int], bool]:
    """Token ids of the conversation, and whether the prompt opened a <think> block the output continues.

    Like LLM.encode_chat, plus continue_final (the reply continues a prefilled assistant message,
    Anthropic style) and the rendered text's end, which encode_chat does not give back. `param`: the request
    field the messages came from, which a 400 names."""
    text = chat_text(llm, messages, tools, template_kwargs, continue_final, param)
    tok = llm.tokenizer
    ids = tok.encode(text, add_special=False)
    # The template normally writes BOS itself; add it only where the model wants one and it is absent.
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids = [tok.bos_id] + ids
    return ids, text.rstrip().endswith("<think>")


def chat_text(llm: LLM, messages: list[dict], tools: list[dict] | None = None,
              template_kwargs: dict | None = None, continue_final: bool = False, param: str = "messages") -> str:
    """The conversation rendered with the model's chat template (a 400 if it has none or it fails, or if a tool
    result answers no call)."""
    if llm.template is None:
        raise bad_request("this model has no chat template; use /v1/completions with a raw prompt")
    check_tool_results(messages, param)
    kwargs = dict(template_kwargs or {})
    clash = RESERVED_VARIABLES & kwargs.keys()
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs")
    try:
        return llm.template.render(messages, tools=tools or None, add_generation_prompt=not continue_final,
                                   continue_final_message=continue_final, **kwargs)
    except ChatTemplateError as exc:
        raise bad_request(f"cannot render the conversation with the model's chat template: {exc}",
                          param=param) from None


def check_tool_results(messages: list[dict], param: str = "messages") -> None:
    """A 400 unless every tool result (a "tool" message: OpenAI's tool message, Anthropic's tool_result block, the
    Responses API's function_call_output) answers a call of the assistant message just before it (other results
    may come between), naming one of its calls' ids where both give ids; as OpenAI and Anthropic refuse it."""
    calls: set[str] | None = None        # the ids of the calls a result may answer now; None: no call to answer
    for message in messages:
        if message.get("role") == "tool":
            answered = message.get("tool_call_id")
            if calls is None:
                raise bad_request(f"a tool result (tool call id {answered!r}) must follow an assistant message "
                                  "that calls tools", param=param)
            if calls and answered is not None and answered not in calls:
                raise bad_request(f"a tool result answers tool call id {answered!r}, which the assistant message "
                                  f"before it does not make (its calls: {', '.join(sorted(calls))})", param=param)
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            calls = {c["id"] for c in message["tool_calls"] if isinstance(c.get("id"), str)}
        else:
            calls = None


def raw_prompts(llm: LLM, prompt, suffix: str | None = None, param: str = "prompt",
                max_prompts: int | None = None) -> list[tuple[list[int], str]]:
    """OpenAI's prompt forms (a string, token ids, or a list of either) -> (ids, text) per prompt. `suffix`:
    fill in the middle between each prompt and it. A 400 naming `param` for an empty prompt, a bad token id,
    or more than `max_prompts` prompts (checked before any is tokenized)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if max_prompts is not None and len(prompt) > max_prompts:
            raise bad_request(f"at most {max_prompts} prompts per request (got {len(prompt)})", param=param)
        return [_raw_prompt(llm, p, suffix, param) for p in prompt]
    if isinstance(prompt, list) and not prompt:
        raise bad_request("the prompt is empty", param=param)
    return [_raw_prompt(llm, prompt, suffix, param)]


def _raw_prompt(llm: LLM, prompt: str | list[int], suffix: str | None, param: str) -> tuple[list[int], str]:
    tok = llm.tokenizer
    if suffix:             # fill in the middle between the prompt and the suffix
        if not isinstance(prompt, str):
            raise bad_request("suffix needs a text prompt (not token ids)", param="suffix")
        try:
            return llm.encode_infill(prompt, suffix), prompt
        except UserError as exc:
            raise bad_request(str(exc), param="suffix") from None
    if isinstance(prompt, str):
        return llm.encode_prompt(prompt), prompt
    bad = next((t for t in prompt if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is outside the vocabulary (size {tok.vocab_size})", param=param)
    return list(prompt), tok.decode(prompt)


def named_tool_only(tools: list[dict], name: str | None, param: str | None = "tool_choice") -> list[dict]:
    """tool_choice naming one tool: offer only that one (OpenAI-shaped tool dicts); a 400 if there is none."""
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise bad_request(f"tool_choice names a tool that is not in tools: {name!r}", param=param)
    return named


class StructuredOutput(NamedTuple):
    """One of vLLM's structured outputs (engine.grammar.structured_grammar), and the request field it came from."""
    kind: str        # json | regex | choice | grammar
    value: Any
    param: str


async def output_grammar(llm: LLM, tools: list[dict] | None, *, force_call: bool, parallel: bool,
                         response_format: dict | None = None, format_param: str = "response_format",
                         structured: StructuredOutput | None = None) -> str | None:
    """The grammar the reply must follow: a call of one of `tools` when tool_choice forces one (required /
    any / a named tool), else the structured output's or the response format's (None: free text).
    A request may constrain its output one way only."""
    if structured is not None:
        if force_call:
            raise bad_request(f"{structured.param} cannot be combined with a tool_choice that forces a call",
                              param=structured.param)
        if response_format and response_format.get("type", "text") != "text":
            raise bad_request(f"{structured.param} cannot be combined with a {format_param} of type "
                              f"{response_format.get('type')!r}", param=structured.param)
        return await _structured_grammar(llm, structured)
    if force_call:
        if not tools:
            raise bad_request("a tool_choice that forces a call needs tools", param="tool_choice")
        return await _tool_call_grammar(llm, tools, parallel)
    return await _response_format_grammar(llm, response_format, format_param)


async def _structured_grammar(llm: LLM, structured: StructuredOutput) -> str:
    try:
        grammar = structured_grammar(structured.kind, structured.value)
        await run_in_threadpool(llm.engine.grammars.check, grammar)    # an invalid regex fails here
    except (ValueError, UserError) as exc:
        raise bad_request(str(exc), param=structured.param) from None
    return grammar


def tool_call_style(template: ChatTemplate | None) -> str:
    """How the chat template shows the model a call (grammar.TOOL_CALL_STYLES): Qwen3-Coder's XML parameters, a
    JSON object in <tool_call> tags, or the bare object."""
    source = template.source if template is not None else ""
    if "<function=" in source and "<parameter=" in source:
        return "xml"
    return "tagged" if "<tool_call>" in source else "json"


async def _tool_call_grammar(llm: LLM, tools: list[dict], parallel: bool) -> str:
    """The grammar that makes the reply a call of one of `tools` (tool_choice required / any / a named tool),
    in the format the chat template shows the model; a tool whose parameters schema does not compile is a 400."""
    try:
        grammar = forced_tool_call_grammar(tools, tool_call_style(llm.template), parallel)
        await run_in_threadpool(llm.engine.grammars.check, grammar)
    except (ValueError, UserError) as exc:
        raise bad_request(f"cannot enforce tool_choice with these tools: {exc}", param="tool_choice") from None
    return grammar


async def _response_format_grammar(llm: LLM, response_format: dict | None, param: str) -> str | None:
    """OpenAI's response_format (json_object / json_schema) -> the grammar the output must follow (None: free text);
    a bad one is a 400 naming `param`."""
    if not response_format:
        return None
    try:
        constrained, schema = schema_from_response_format(response_format)
        if not constrained:
            return None
        grammar = json_grammar(schema)
        await run_in_threadpool(llm.engine.grammars.check, grammar)    # a big schema takes a while
    except (ValueError, UserError) as exc:
        raise bad_request(str(exc), param=param) from None
    return grammar


def check_prompt_fits(llm: LLM, n_prompt: int, param: str) -> None:
    limit = llm.engine.max_context
    if n_prompt == 0:
        raise bad_request("the prompt is empty", param=param)
    if n_prompt >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                            f"has {n_prompt} prompt tokens (plus at least 1 to generate). Please reduce "
                            f"the length of the messages or prompt.", param=param, code="context_length_exceeded")


def max_new_tokens(ctx: ServerContext, requested: int | None, n_prompt: int) -> int:
    """What the client asked for, or else the server's default (serve -n), or else whatever room the context
    has left (the default too is cut to that room)."""
    if requested is not None:
        return requested
    room = max(1, ctx.llm.engine.max_context - n_prompt)
    default = ctx.options.sampling_defaults.get("max_tokens")
    return room if default is None else min(default, room)
