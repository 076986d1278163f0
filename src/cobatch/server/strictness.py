"""What the server refuses instead of silently ignoring: a model it does not serve (404 model_not_found, as
vLLM answers) and fields it does not implement, sampling ones and hosted features (400 naming the field; an
endpoint whose request model declares one of them implements it there).

A refused field left at its neutral value (typical_p 1, mirostat 0, dry_multiplier 0, xtc_probability 0,
dynatemp_range 0, use_beam_search false, background false, mcp_servers []) is a documented no-op and passes: clients
that send every knob at its default work.
"""

from __future__ import annotations

from typing import Any

from cobatch.server.errors import ApiError, bad_request

# field -> its neutral value (None: any value is refused)
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_beam_search": False, "typical_p": 1.0, "mirostat": 0, "mirostat_mode": 0, "mirostat_tau": None,
    "mirostat_eta": None, "dry_multiplier": 0.0, "dry_base": None, "dry_allowed_length": None,
    "dry_penalty_last_n": None, "dry_sequence_breakers": None, "xtc_probability": 0.0, "xtc_threshold": None,
    "prompt_logprobs": None, "dynatemp_range": 0.0, "dynatemp_exponent": None,
    # what OpenAI's and Anthropic's own storage and workers give (the routes that implement one declare it:
    # a completions prompt, chat's top_logprobs): background runs, stored prompts, conversations, remote MCP
    # servers, code containers
    "background": False, "prompt": None, "conversation": None, "top_logprobs": 0, "mcp_servers": [],
    "container": None,
}


def refuse_unsupported(given: dict, implemented=()) -> None:
    """A 400 naming the first field the request body (the JSON object) sets that this server does not implement
    (except those `implemented` names: the endpoint's request model declares them)."""
    for name, neutral in UNSUPPORTED_FIELDS.items():
        value = given.get(name)
        if name in implemented:
            continue
        if value is None or (neutral is not None and value == neutral):
            continue
        if name.startswith(("dry_", "mirostat_", "xtc_", "dynatemp_")) and _family_off(given, name):
            continue              # a parameter of a sampler left off (e.g. dry_base with dry_multiplier 0)
        raise bad_request(f"{name} is not supported by this server (remove it, or set it to its neutral value"
                          f"{f' {neutral!r}' if neutral is not None else ''})", param=name)


def _family_off(given: dict, name: str) -> bool:
    switch = {"dry_": "dry_multiplier", "mirostat_": "mirostat", "xtc_": "xtc_probability",
              "dynatemp_": "dynatemp_range"}
    key = next(v for k, v in switch.items() if name.startswith(k))
    if key == "mirostat" and given.get("mirostat_mode") not in (None, 0):
        return False
    return given.get(key) in (None, 0, 0.0) and key != name


def check_model(names: tuple[str, ...], accept_any: bool, requested: str | None) -> None:
    """A 404 model_not_found unless `requested` is unset, one of the served names, or any name is accepted."""
    if requested is None or accept_any or requested in names:
        return
    raise ApiError(404, f"The model {requested!r} does not exist (this server serves {', '.join(map(repr, names))})",
                   param="model", code="model_not_found")
