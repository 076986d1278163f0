"""Chat messages -> prompt text, with the Jinja chat template stored in the GGUF.

Templates are written for HF transformers' `apply_chat_template`, so we give them the same
environment: a sandbox with trim_blocks/lstrip_blocks and loop controls, HF's `tojson` (no HTML
escaping, with indent/separators/sort_keys), `raise_exception`, `strftime_now`, `bos_token` and
`eos_token`, `{% generation %}` blocks, and messages with None-valued keys removed.
Templates come from untrusted files, hence the sandbox.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from cobatch.tokenizer import Tokenizer

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# Names a message's reasoning may come under; templates read the first one (HF's convention).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the final message to find where it ends once rendered (continue_final_message).
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """No usable chat template, a template that does not compile, or one that refused to render."""


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation; the message is meant for the API caller.
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '), which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _DictFactory:
    """`dict(...)` for templates, without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training
    masks); for prompting it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _DictFactory()
    return env


def _plain(value: Any) -> Any:
    """A copy built from plain JSON types, so the template sees no caller objects (and cannot
    change the caller's messages)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):  # subclasses (enums, ...) carry methods the sandbox does not vet
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models (API request bodies)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: list[Any], none_content: bool = False) -> list[dict]:
    """Plain copies of the messages, null fields dropped; none_content: a null content stays None beside tool
    calls (for a template that tests `content is none`, as DeepSeek's do)."""
    normalized = []
    for message in _plain(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be objects with a role, got {message!r}")
        # `content: null` / `tool_calls: null` from API clients: templates test for a missing key, and would
        # otherwise render "None" or fail on concatenation. A null content beside nothing but tool calls is empty
        # text: most templates read it unguarded (SmolLM2's, as OpenAI clients send such a turn back); beside
        # reasoning it is dropped (templates test whether it is defined).
        if message.get("content", "") is None and not any(message.get(k) for k in _REASONING_FIELDS) \
                and not (none_content and message.get("tool_calls")):
            message = {**message, "content": ""}
        message = {k: v for k, v in message.items()
                   if v is not None or (k == "content" and none_content and message.get("tool_calls"))}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


# Mistral's templates reject tool-call ids that are not 9 alphanumerics (its tokenizer's format). Ids from any
# client (OpenAI's "call_...", Anthropic's "toolu_...", ours) are mapped to 9 stable alphanumerics for such a
# template: a call and its result map to the same short id, so the pairing the template checks survives.
_NINE_CHAR_ID_CHECK = re.compile(r"length\s*[!=]=\s*9\b")
_NINE_CHAR_ID = re.compile(r"[A-Za-z0-9]{9}")


# DeepSeek's templates (V3, R1) concatenate a tool call's arguments as text ('...' + tool['function']['arguments']),
# where transformers' convention, and what the server passes, is the object: such a template gets the JSON text.
# ... and test a tool-call message's content for none, which the null fields dropped would make undefined
_TESTS_CONTENT_IS_NONE = re.compile(r"(?:\['content'\]|\.content)\s+is\s+none")
_ARGUMENTS_AS_TEXT = re.compile(r"\+\s*\w+(?:\['function'\]|\.function)(?:\['arguments'\]|\.arguments)")


def _with_text_arguments(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        if isinstance(message.get("tool_calls"), list):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and not isinstance(function.get("arguments", ""), str):
                    call = {**call, "function": {**function,
                                                 "arguments": json.dumps(function["arguments"], ensure_ascii=False)}}
                calls.append(call)
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _nine_char_id(tool_call_id: Any) -> Any:
    if not isinstance(tool_call_id, str) or _NINE_CHAR_ID.fullmatch(tool_call_id):
        return tool_call_id
    return hashlib.sha256(tool_call_id.encode()).hexdigest()[:9]


def _with_nine_char_ids(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        message = dict(message)
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [{**c, "id": _nine_char_id(c["id"])} if isinstance(c, dict) and "id" in c else c
                                     for c in message["tool_calls"]]
        if "tool_call_id" in message:
            message["tool_call_id"] = _nine_char_id(message["tool_call_id"])
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # template variables every render takes unless the call sets them (vLLM's --default-chat-template-kwargs,
        # e.g. {"enable_thinking": false})
        self.defaults: dict[str, Any] = {}
        self._nine_char_ids = bool(_NINE_CHAR_ID_CHECK.search(source))
        self._text_arguments = bool(_ARGUMENTS_AS_TEXT.search(source))
        self._none_content = bool(_TESTS_CONTENT_IS_NONE.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate:
        source = metadata.get(CHAT_TEMPLATE_KEY)
        if not source:
            raise ChatTemplateError(
                f"model has no chat template ({CHAT_TEMPLATE_KEY} missing); use raw generation"
            )
        return cls.with_tokenizer(str(source), tokenizer)

    @classmethod
    def with_tokenizer(cls, source: str, tokenizer: Tokenizer) -> ChatTemplate:
        """`source` with the vocabulary's BOS/EOS texts as bos_token / eos_token."""
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        return cls(source, bos_token=bos, eos_token=eos)

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`. `tools` are JSON-schema function descriptions
        ({"type": "function", "function": {...}}). `continue_final_message` leaves the last
        (assistant) message open so generation continues it, e.g. a prefilled answer.
        Extra keyword arguments reach the template as variables (e.g. enable_thinking)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other")
        chat = _normalize_messages(messages, none_content=self._none_content)
        if self._nine_char_ids:
            chat = _with_nine_char_ids(chat)
        if self._text_arguments:
            chat = _with_text_arguments(chat)
        final_content = None
        if continue_final_message:
            final_content = chat[-1].get("content") if chat else None
            if not isinstance(final_content, str):
                raise ChatTemplateError("continue_final_message needs a final message with text content")
            chat[-1]["content"] = final_content + _CONTINUE_MARK

        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self.defaults, **_plain(extra)}
        variables.setdefault("documents", None)
        try:
            rendered = self._template.render(
                messages=chat,
                tools=_plain(tools),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc

        if continue_final_message:
            rendered = self._cut_after_final_message(rendered, final_content)
        return rendered

    @staticmethod
    def _cut_after_final_message(rendered: str, final_content: str) -> str:
        mark = _CONTINUE_MARK.strip()
        at = rendered.rfind(mark)
        if at < 0 or final_content.strip() not in rendered:
            raise ChatTemplateError("chat template dropped the final message; cannot continue it")
        # Templates that strip message content also strip the space after the mark.
        if rendered.startswith(_CONTINUE_MARK, at):
            return rendered[:at]
        return rendered[:at].rstrip()


# Variables a conversation's render sets itself: neither a request nor the defaults may set them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


def template_kwargs_flags(args) -> dict | None:
    """The template variables the command line sets for every conversation: vLLM's --default-chat-template-kwargs
    or llama.cpp's --chat-template-kwargs (a JSON object), and llama.cpp's --reasoning-budget (-1: unrestricted;
    0: thinking off, enable_thinking false). A bad value is a UserError naming the flag."""
    from cobatch.errors import UserError, json_object_flag
    raw = getattr(args, "chat_template_kwargs", None)
    kwargs = {}
    if raw is not None:
        kwargs = json_object_flag(raw, "--chat-template-kwargs")
        clash = sorted(RESERVED_VARIABLES & kwargs.keys())
        if clash:
            raise UserError(f"--chat-template-kwargs may not set {clash}")
    budget = getattr(args, "reasoning_budget", None)
    if budget is not None:
        if budget not in (-1, 0):
            raise UserError(f"--reasoning-budget: -1 (unrestricted) or 0 (no thinking), as llama.cpp takes it "
                            f"(got {budget})")
        if budget == 0:
            kwargs.setdefault("enable_thinking", False)
    return kwargs or None
