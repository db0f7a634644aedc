"""Bad input, as the tools below the CLI report it: ``InputError``'s message is one line naming what is wrong.

The command-line modules catch it and print it as ``error: <message>`` on stderr, exit status 2.
"""


class InputError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""
