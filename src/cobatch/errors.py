"""Errors a user can cause (bad file, bad argument): the CLI prints them as one line and exits 2."""


import json


class UserError(Exception):
    """Bad input from the user; str(err) is the whole message."""


def json_object_flag(raw: str, flag: str) -> dict:
    """A command-line flag's JSON object, or a UserError naming the flag."""
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise UserError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag}: it must be a JSON object")
    return value
