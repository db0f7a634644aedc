"""Bad input on the command line, as every tool here reports it: one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys

from openrlhf_populora.errors import InputError

__all__ = ["InputError", "OneLineParser"]  # InputError lives below the CLI (the modules that raise it do too)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (``error: ... (see --help)``, no usage block), exit 2.
    ``with_prog``: the line starts with the (sub)command's name, for tools with subcommands."""

    with_prog = False

    def error(self, message: str):
        prefix = f"{self.prog}: " if self.with_prog else ""
        print(f"{prefix}error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
