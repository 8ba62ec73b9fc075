"""The one exception type for bad user input in this project.

Library code raises ``UserError`` with a one-line message that names the problem
and the fix; the command-line entry points print it and exit non-zero, never a
traceback.
"""


class UserError(Exception):
    """Bad input from the user: a one-line message naming the problem and the fix."""
