"""The house's one-way rule for the CLI: nothing imports ``cli/`` but ``cli/`` itself.

The command-line modules only parse flags, call one function and print. Code that a worker, the trainer, a patch or
a benchmark needs lives below them, so no module outside ``cli/`` imports one, and no string names one for
something to import by name (a Ray worker's setup hook, vLLM's worker extension, the trainer's run function).
A user-facing command in a message (``python -m openrlhf_populora.cli.report DIR``) is not an import.
"""

import ast
import re
from pathlib import Path

from paths import ROOT

PACKAGE = ROOT / "openrlhf_populora"
CHECKED = [PACKAGE, ROOT / "patches", ROOT / "benchmarks"]
CLI = PACKAGE / "cli"
# a dotted name inside cli/ followed by an attribute (``cli.stock_ppo.CpuWorkerWrap``, ``cli.ray_launch:run``), not
# preceded by ``-m`` (a command line shown to a user)
NAMED = re.compile(r"(?<!-m )openrlhf_populora\.cli\.\w+[.:]\w")


def python_files(with_cli: bool = False) -> list[Path]:
    return sorted(p for root in CHECKED for p in root.rglob("*.py") if with_cli or CLI not in p.parents)


def cli_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("openrlhf_populora.cli")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("openrlhf_populora.cli") or (
                    node.module == "openrlhf_populora" and any(a.name == "cli" for a in node.names)):
                found.append(node.module)
    return found


def cli_names_in_strings(tree: ast.AST) -> list[str]:
    return [m.group(0) for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            for m in NAMED.finditer(node.value)]


def offenders(check, with_cli: bool = False) -> list[str]:
    out = []
    for path in python_files(with_cli):
        for name in check(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            out.append(f"{path.relative_to(ROOT)}: {name}")
    return out


def test_no_module_outside_cli_imports_it():
    # Catches: a patch importing cli.ray_launch's tables, a benchmark building its engine through cli.train.
    assert python_files() and offenders(cli_imports) == []


def test_no_string_names_a_cli_module_for_something_to_import():
    # Catches: a worker setup hook or a vLLM worker extension named as "openrlhf_populora.cli.stock_ppo.X", or the
    # trainer's run function as "openrlhf_populora.cli.ray_launch:run_selfplay" (cli/ included: such a name is
    # an import of cli/ by whatever resolves it).
    assert offenders(cli_names_in_strings, with_cli=True) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    # The scans themselves, on code that breaks the rule in each way and code that does not.
    bad = ast.parse("import openrlhf_populora.cli.train\nfrom openrlhf_populora.cli.ray_launch import SWAPS\n"
                    "from openrlhf_populora import cli\nHOOK = 'openrlhf_populora.cli.stock_ppo.setup'\n"
                    "RUNNER = 'openrlhf_populora.cli.ray_launch:run_selfplay'\n")
    good = ast.parse("from openrlhf_populora.config import Config\n"
                     "HELP = 'run python -m openrlhf_populora.cli.report DIR'\n")
    assert cli_imports(bad) == ["openrlhf_populora.cli.train", "openrlhf_populora.cli.ray_launch", "openrlhf_populora"]
    assert cli_names_in_strings(bad) == ["openrlhf_populora.cli.stock_ppo.s", "openrlhf_populora.cli.ray_launch:r"]
    assert cli_imports(good) == [] and cli_names_in_strings(good) == []
