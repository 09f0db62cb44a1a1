"""The one exception type for bad user input.

Entry points catch it, print ``error: <message>`` on one line and exit 2, so a typo in a config never
ends in a traceback.
"""


class UserError(Exception):
    """Bad input from the user: a config, a flag, a path. The message says what is wrong and how to fix it."""


USER_ERROR_EXIT_CODE = 2
