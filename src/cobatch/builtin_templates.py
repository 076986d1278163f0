"""Chat templates by name (--chat-template chatml), for models whose GGUF has none or a broken one.

`template_source(value)` turns a --chat-template value into Jinja text: a built-in name, a file, or the
template itself; anything else is a UserError (text like "chatm" is a typo, not a template to render).
"""

from __future__ import annotations

from pathlib import Path

from cobatch.errors import UserError

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% elif m['role'] == 'system' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}


def template_source(value: str) -> str:
    """--chat-template's Jinja text: the built-in of that name, the file at that path, or the value itself when
    it is template text (holds {{ or {%)."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --chat-template {value}: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise UserError(f"--chat-template {value!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}), "
                    "a file, nor Jinja template text")
