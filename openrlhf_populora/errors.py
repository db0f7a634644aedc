"""Bad input, as every entry point reports it: one line on stderr, exit status 2 (``cli/errors.py``).

It lives below the CLI so that what the CLI calls (a study's plan, ``studies/``) can raise it.
"""


class InputError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""
