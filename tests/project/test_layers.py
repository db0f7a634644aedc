"""The layers of docs/architecture.md, one way down: a module imports only its own layer and the layers listed
before it, at any depth (function-level imports included). One arrow points up by design, and only it."""

from __future__ import annotations

import ast

from paths import ROOT

# docs/architecture.md's table, in order; a name is a package or a top-level module of openrlhf_populora
# ("patches" is the installed openrlhf_populora.patches, from patches/ in the repository)
LAYERS = [
    ("rules", {"sandbox", "tasks", "rewards", "population", "evolution", "config", "durable", "dirlock",
               "launch_checks", "errors"}),
    ("collection", {"metrics"}),
    ("analysis", {"analysis"}),
    ("engines", {"engines", "models", "patches"}),
    ("loop", {"selfplay"}),
    ("composition", {"build", "preflight"}),
    ("studies", {"studies"}),
    ("stock OpenRLHF's inputs", {"openrlhf_reward", "openrlhf_dataset"}),
    ("evaluation", {"eval"}),
    ("entry points", {"cli"}),
]
LEVEL = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}
# the lock tool (run by hand and by a test) pins what the launch really swaps and parses: it reads build.ray
BY_DESIGN = {("patches/openrlhf_0_11_2/lock.py", "build")}


def _unit(path) -> str:
    if path.parts[len(ROOT.parts)] == "patches":
        return "patches"
    return path.relative_to(ROOT / "openrlhf_populora").parts[0].removesuffix(".py")


def upward_imports() -> list[str]:
    found = []
    files = [*(ROOT / "openrlhf_populora").rglob("*.py"), *(ROOT / "patches").rglob("*.py")]
    for path in sorted(files):
        here = _unit(path)
        if here not in LEVEL and here != "__init__":
            found.append(f"{path.relative_to(ROOT)}: in no layer")
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                       else [])
            for module in modules:
                parts = module.split(".")
                if parts[0] != "openrlhf_populora" or len(parts) < 2 or here == "__init__":
                    continue
                there = parts[1]
                if LEVEL.get(there, -1) > LEVEL[here] and (str(path.relative_to(ROOT)), there) not in BY_DESIGN:
                    found.append(f"{path.relative_to(ROOT)} ({LAYERS[LEVEL[here]][0]}) imports {module} "
                                 f"({LAYERS[LEVEL[there]][0]})")
    return found


def test_every_import_points_down_the_layers():
    """Catches: an engine reaching the loop, the loop reaching composition or evaluation, analysis reaching an
    engine (it reads finished runs' files), a new package that no layer holds."""
    assert upward_imports() == []
