"""The one exception type the CLI turns into a single clear line (no traceback without --debug)."""


class KilnError(Exception):
    """A user-facing error: the message names the file, field or value and what was expected."""
