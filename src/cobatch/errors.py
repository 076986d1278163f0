"""Errors a user can cause (bad file, bad argument): the CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Bad input from the user; str(err) is the whole message."""
