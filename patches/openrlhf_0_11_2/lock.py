"""The upstream lock: source hashes of everything the plugin replaces or relies on in OpenRLHF 0.11.2.

``python -m openrlhf_populora.patches.openrlhf_0_11_2.lock [--check | --write]``

``upstream.lock.json`` records, for the installed ``openrlhf``:

- ``sources``: ``source_hash`` (sha256 of ``inspect.getsource``) of every upstream function, method or class in
  :data:`RELIED_ON` and of every target of every registered patch list (:func:`patch_targets`); a target whose
  original is not upstream code (the module global ``torch`` of an upstream module) is locked by the source of
  that upstream module;
- ``files``: the sha256 of ``openrlhf/cli/train_ppo_ray.py``, whose ``__main__`` block the launch runs;
- ``flags``: upstream's ``train_ppo_ray`` flags, ``flag -> {dest, default}`` (JSON-safe, :func:`flag_snapshot`).

``--check`` (the default) exits 1 and names every difference; ``--write`` rewrites the file. Run ``--write``
only after reading the upstream change and adapting the plugin to it. ``tests/unit/patches/test_openrlhf.py`` runs
the same comparison.

Hashing only reads source, but importing the upstream modules needs ``vllm`` and ``flash_attn``. Where they do
not import (a CPU machine), the CLI puts inert placeholder modules in their place for the duration.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import json
import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openrlhf_populora.patches import openrlhf_0_11_2 as patches

_PPO = "openrlhf.trainer.ppo_trainer"
_ACTOR = "openrlhf.trainer.ray.ppo_actor"
_VLLM = "openrlhf.trainer.ray.vllm_engine"
_EXP = "openrlhf.trainer.ppo_utils.experience_maker"
_DS = "openrlhf.utils.deepspeed.deepspeed"

# Upstream code whose behaviour the plugin's subclasses call, override or depend on (reference notes §6.7).
# "module:Class.attr" on a Ray actor class means the method of the class it wraps.
RELIED_ON: tuple[str, ...] = (
    "openrlhf.cli.train_ppo_ray:train",
    f"{_VLLM}:create_vllm_engines",
    f"{_VLLM}:RolloutRayActor.__init__",
    f"{_VLLM}:RolloutRayActor.generate",
    f"{_VLLM}:RolloutRayActor.generate_responses",
    f"{_ACTOR}:ActorPPOTrainer.training_step",
    f"{_ACTOR}:ActorPPOTrainer.ppo_train",
    f"{_ACTOR}:ActorPPOTrainer.broadcast_to_vllm",
    f"{_ACTOR}:PolicyModelActor.init_model_from_pretrained",
    f"{_ACTOR}:PolicyModelActor.forward",
    f"{_ACTOR}:PolicyModelActor.fit",
    f"{_PPO}:PPOTrainer.__init__",
    f"{_PPO}:PPOTrainer.fit",
    f"{_PPO}:PPOTrainer.train_step",  # defined on BasePPOTrainer; hashed where PPOTrainer finds it
    f"{_PPO}:PPOTrainer.ppo_train",
    f"{_PPO}:BasePPOTrainer.__init__",
    f"{_EXP}:RemoteExperienceMaker.make_experience",
    f"{_EXP}:RemoteExperienceMaker.make_experience_batch",
    f"{_EXP}:RemoteExperienceMaker.compute_advantages_and_returns",
    f"{_EXP}:RemoteExperienceMaker.get_cumulative_returns",
    "openrlhf.models.utils:compute_reward",
    "openrlhf.trainer.ppo_utils.samples_generator:SamplesGenerator._dispatch_prompts_to_vllm",
    f"{_DS}:DeepspeedStrategy.setup_distributed",
    f"{_DS}:DeepspeedStrategy.prepare",
    f"{_DS}:DeepspeedStrategy.save_ckpt",
    f"{_DS}:DeepspeedStrategy.load_ckpt",
    "openrlhf.trainer.ray.launcher:RayActorGroup.async_run_method_batch",
    "openrlhf.utils.config:hierarchize",
)

# Files hashed byte for byte (paths inside the openrlhf package).
FILES: tuple[str, ...] = ("cli/train_ppo_ray.py",)

# Defaults that upstream computes when the parser is built; the lock records a description instead.
VOLATILE_DEFAULTS = {"logger.wandb.run_name": "<ppo_%m%dT%H:%M at parse time>"}


def patch_targets() -> list[str]:
    """Targets of every registered patch list: the Ray launch's class swaps, and the CPU patches where
    ``patches/openrlhf_0_11_2/cpu.py`` imports."""
    from openrlhf_populora.build.ray import SWAPS

    targets = [target for target, _, _ in SWAPS]
    try:
        from openrlhf_populora.patches.openrlhf_0_11_2.cpu import cpu_patches
    except ImportError:
        pass
    else:
        targets += [patch.target for patch in cpu_patches()]
    return targets


def all_targets() -> list[str]:
    return sorted(set(RELIED_ON) | set(patch_targets()))


def _original(target: str) -> Any:
    """The upstream object at ``target`` (the original, if a patch currently replaces it), looking through Ray
    actor classes to the class they wrap."""
    module_name, _, path = target.partition(":")
    parts = path.split(".")
    owner: Any = patches.original(f"{module_name}:{parts[0]}")
    for i in range(1, len(parts)):
        prefix = f"{module_name}:{'.'.join(parts[:i + 1])}"
        owner = (patches.original(prefix) if prefix in patches.applied()
                 else getattr(getattr(owner, "__ray_actor_class__", owner), parts[i]))
    return owner


def _locked_object(target: str) -> Any:
    """What the lock hashes for ``target``: the upstream object itself, or, when the original is not upstream code
    (a module global such as ``torch``, or a function imported from torch), the upstream module holding the
    name, whose use of it the patch relies on."""
    obj = _original(target)
    inner = getattr(obj, "__ray_actor_class__", obj)
    home = inner.__name__ if isinstance(inner, types.ModuleType) else getattr(inner, "__module__", "") or ""
    if home == "openrlhf" or home.startswith("openrlhf."):
        return obj
    return importlib.import_module(target.partition(":")[0])


def source_hashes(targets: list[str] | None = None) -> dict[str, str]:
    return {target: patches.source_hash(_locked_object(target)) for target in (targets or all_targets())}


def file_hashes() -> dict[str, str]:
    root = Path(importlib.import_module("openrlhf").__file__).parent
    return {f"openrlhf/{rel}": hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in FILES}


def json_safe(value: Any) -> Any:
    """Defaults as JSON values: tuples become lists, non-finite floats their ``repr`` (``"inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def flag_snapshot(parser: argparse.ArgumentParser, flags: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``flag -> {"dest", "default"}`` for the parser's options (all but ``-h``, or only ``flags``), JSON-safe.

    Keyed by flag, not dest: upstream's ``--actor.muon.no_nesterov`` shares its dest with ``--actor.muon.nesterov``
    (167 flags, 165 dests).
    """
    snapshot = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if flags is not None and flag not in flags:
            continue
        default = VOLATILE_DEFAULTS.get(action.dest, json_safe(action.default))
        snapshot[flag] = {"dest": action.dest, "default": default}
    return dict(sorted(snapshot.items()))


def compute() -> dict[str, Any]:
    """The lock as it would be written for the installed upstream."""
    from openrlhf_populora.build.ray import upstream_parser

    return {
        "openrlhf_version": patches.installed_version(),
        "files": file_hashes(),
        "sources": dict(sorted(source_hashes().items())),
        "flags": flag_snapshot(upstream_parser()),
    }


def differences(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Human-readable differences between a stored lock and a computed one (empty: they agree)."""
    lines = []
    if expected.get("openrlhf_version") != found.get("openrlhf_version"):
        lines.append(f"openrlhf version: lock {expected.get('openrlhf_version')}, "
                     f"installed {found.get('openrlhf_version')}")
    for section in ("files", "sources", "flags"):
        old, new = expected.get(section, {}), found.get(section, {})
        for key in sorted(set(old) | set(new)):
            if key not in new:
                lines.append(f"{section}: {key} is in the lock but no longer upstream / registered")
            elif key not in old:
                lines.append(f"{section}: {key} is not in the lock (run --write after reviewing it)")
            elif old[key] != new[key]:
                lines.append(f"{section}: {key} changed: lock {old[key]!r}, installed {new[key]!r}")
    return lines


def write(lock: dict[str, Any], path: Path = patches.LOCK_FILE) -> None:
    """Sorted JSON, one entry per line inside each section (readable diffs)."""
    lines = ["{"]
    sections = sorted(lock)
    for i, section in enumerate(sections):
        value = lock[section]
        tail = "," if i < len(sections) - 1 else ""
        if not isinstance(value, dict):
            lines.append(f"  {json.dumps(section)}: {json.dumps(value)}{tail}")
            continue
        lines.append(f"  {json.dumps(section)}: {{")
        items = sorted(value.items())
        lines += [f"    {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{',' if j < len(items) - 1 else ''}"
                  for j, (k, v) in enumerate(items)]
        lines.append(f"  }}{tail}")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``vllm``/``flash_attn`` (and submodules) as empty packages whose every attribute is an inert class."""

    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0+placeholder"
        module.__getattr__ = lambda attr: type(attr, (), {}) if not attr.startswith("__") else _raise(attr)
        return module

    def exec_module(self, module) -> None:
        pass


def _raise(attr: str):
    raise AttributeError(attr)


@contextlib.contextmanager
def placeholders_for_missing(names: tuple[str, ...] = ("vllm", "flash_attn")) -> Iterator[list[str]]:
    """Stand in inert placeholder modules for the packages in ``names`` that fail to import; removes them (and
    every module imported meanwhile) afterwards. Yields the names that were replaced."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            missing.append(name)
    if not missing:
        yield []
        return
    before = set(sys.modules)
    finder = _Placeholders(set(missing))
    sys.meta_path.insert(0, finder)
    try:
        yield missing
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            del sys.modules[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_populora.patches.openrlhf_0_11_2.lock",
                                     description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare the lock with the installed upstream (default)")
    mode.add_argument("--write", action="store_true", help=f"rewrite {patches.LOCK_FILE.name}")
    args = parser.parse_args(argv)
    try:
        patches.check_version()
    except patches.UpstreamVersionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    with placeholders_for_missing() as replaced:
        if replaced:
            print(f"[lock] {', '.join(replaced)} not importable: inert placeholders stand in while hashing",
                  file=sys.stderr)
        found = compute()
    if args.write:
        write(found)
        print(f"wrote {patches.LOCK_FILE} ({len(found['sources'])} sources, {len(found['flags'])} flags)")
        return 0
    diff = differences(patches.load_lock(), found)
    for line in diff:
        print(line)
    print(f"{patches.LOCK_FILE.name}: {'OUT OF DATE' if diff else 'matches'} openrlhf=={found['openrlhf_version']}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
