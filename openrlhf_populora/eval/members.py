"""What to evaluate: members of a run directory (adapters, checked for compatibility) and full models.

A run directory (written by the training loop) holds ``config.yaml`` (base model under
``actor.model_name_or_path``; whether prompts were rendered with the chat template under
``populora.chat_template``), ``population.json`` (members, roles, ratings, birth steps), ``metrics.jsonl`` and
one PEFT adapter per member under ``adapters/<member_id>/`` (``adapter_config.json`` +
``adapter_model.safetensors``). The evaluator itself only needs (base model, {name: adapter directory}); this
module is the one place that knows the run layout.

**Untrained members.** A living member is *trained* when ``metrics.jsonl`` records an update of its own
adapter: a training diagnostic under its id (``member/<id>/<role>/all/policy_loss`` or ``grad_norm``), which
the loop logs only for the member that trained in a slot, after its birth. A member with none never took an
update: a child born at the run's last step (runs from before the loop's last-step guard), or one whose
rewards never varied. ``EvalMember.untrained`` then says why; evaluation leaves such members out unless asked.
A run without ``metrics.jsonl`` cannot tell: its members count as trained.

A *full model* (``--model NAME=DIR``: a fine-tuned HF model directory such as stock OpenRLHF's
``train_ppo_ray --ckpt.save_hf`` output, with ``config.json``, the weights and the tokenizer files, no adapter)
is its own base: its ``EvalMember`` has no adapter and names the directory in ``model_dir``, and the evaluation
generates for it with an engine loaded from that directory (:func:`check_model_dir` checks one).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from openrlhf_populora.analysis.runs import read_jsonl

BASE_MEMBER = "base"  # the name the base model (no adapter) gets in results
SOLVER_ROLES = ("student", "both")
STOCK_ROLE = "stock"  # the role of a full model (--model): the stock OpenRLHF baseline (B2)
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # HF weight files (one file, or shards with an index)
# files besides the weights that change what a full model generates: architecture, generation defaults, and the
# tokenizer with its chat template (prompts are rendered with the model's own)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
               "chat_template.jinja", "chat_template.json")


@dataclass
class EvalMember:
    """One thing to evaluate: an adapter directory, the base model when ``adapter_dir`` is None, or a full model
    (its own base, no adapter) when ``model_dir`` is set."""

    name: str
    adapter_dir: Path | None
    role: str = "member"  # teacher / student / both (baseline agent) / member (unknown) / base / stock
    rating: float | None = None  # rating mean mu (what selection ranks by) when the run recorded one
    model_dir: Path | None = None  # a full HF model directory generated with instead of the base model
    untrained: str | None = None  # why the member never took an update (None: trained, or not known)


@dataclass
class RunMembers:
    run_dir: Path
    base_model: str
    members: list[EvalMember]
    chat_template: bool | None = None  # populora.chat_template of the training; None: not recorded


def _read_config(run_dir: Path, required: bool) -> dict[str, Any]:
    """The run's ``config.yaml`` as a dict ({} when absent and not ``required``)."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        if not required:
            return {}
        raise ValueError(f"{config_path} not found: is {run_dir} a run directory? Fix: pass the run's directory "
                         "(the training output_dir) or give the base model with --base-model.")
    try:
        config = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{config_path} is not valid YAML: {exc}") from None
    return config if isinstance(config, dict) else {}


def _read_base_model(run_dir: Path, config: dict[str, Any]) -> str:
    model = (config.get("actor") or {}).get("model_name_or_path")
    if not model:
        raise ValueError(f"{run_dir / 'config.yaml'} has no actor.model_name_or_path. Fix: add it or pass --base-model.")
    return str(model)


def _read_chat_template(run_dir: Path, config: dict[str, Any]) -> bool | None:
    """``populora.chat_template`` of the run's training: True / False, or None when config.yaml lacks it."""
    populora = config.get("populora")
    value = populora.get("chat_template") if isinstance(populora, dict) else None
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{run_dir / 'config.yaml'}: populora.chat_template must be true or false, got {value!r}")
    return value


def _adapter_dir(adapters: Path, member: dict[str, Any]) -> Path | None:
    for name in (member.get("id"), member.get("adapter")):
        if name and (adapters / str(name) / "adapter_config.json").is_file():
            return adapters / str(name)
    return None


TRAINING_DIAGNOSTICS = ("policy_loss", "grad_norm")  # metric names the loop logs for a member that trained


def read_training(run_dir: Path) -> tuple[set[str], int] | None:
    """``(members that took at least one update, the last step logged)`` from the run's ``metrics.jsonl``;
    None without one. A damaged line is an error naming it: a guess at who trained would pick the bests."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = read_jsonl(path, None)
    updated: set[str] = set()
    for record in records:
        for key, value in record.items():
            parts = key.split("/")
            if (len(parts) == 5 and parts[0] == "member" and parts[3] == "all" and parts[4] in TRAINING_DIAGNOSTICS
                    and isinstance(value, (int, float))):
                updated.add(parts[1])
    return updated, max((record["step"] for record in records), default=0)


def _untrained(record: dict[str, Any], training: tuple[set[str], int] | None) -> str | None:
    """Why a living member of population.json never took an update, or None (trained, or not known)."""
    if training is None or str(record["id"]) in training[0]:
        return None
    birth, last = record.get("birth_step"), training[1]
    if isinstance(birth, int) and birth >= last:
        return f"born at step {birth}, the run's last step"
    return f"no update since its birth at step {birth}" if isinstance(birth, int) else "no update logged"


def load_run_members(run_dir: str | Path, base_model: str | None = None) -> RunMembers:
    """The base model, the living members of a run (each with its adapter directory) and whether the run
    trained on chat-formatted prompts."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist. Fix: pass --run <the training output_dir>.")
    config = _read_config(run_dir, required=base_model is None)
    base = base_model or _read_base_model(run_dir, config)
    adapters = run_dir / "adapters"
    population_path = run_dir / "population.json"
    members: list[EvalMember] = []
    if population_path.is_file():
        try:
            data = json.loads(population_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{population_path} is not valid JSON ({exc.msg})") from None
        records = data.get("members") if isinstance(data, dict) else None
        if not isinstance(records, list):
            raise ValueError(f"{population_path} has no 'members' list")
        training = read_training(run_dir)
        for record in records:
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f"{population_path}: every member needs an 'id', got {record!r:.80}")
            if record.get("retired_step") is not None:
                continue
            adapter_dir = _adapter_dir(adapters, record)
            if adapter_dir is None:
                raise ValueError(
                    f"member {record['id']!r} of {population_path} has no adapter: expected "
                    f"{adapters / str(record['id']) / 'adapter_config.json'}. Fix: evaluate a run whose adapters "
                    "were saved (training writes them at the end and at every checkpoint)."
                )
            rating = record.get("rating") or {}
            mu = rating.get("mu", rating.get("conservative")) if isinstance(rating, dict) else None
            members.append(EvalMember(str(record["id"]), adapter_dir, str(record.get("role", "member")), mu,
                                      untrained=_untrained(record, training)))
    elif adapters.is_dir():
        for path in sorted(adapters.iterdir()):
            if (path / "adapter_config.json").is_file():
                members.append(EvalMember(path.name, path))
    if not members:
        raise ValueError(f"run directory {run_dir} has no adapters (expected {adapters}/<member_id>/adapter_config.json "
                         "and adapter_model.safetensors). Fix: train first, or point --run at a finished run.")
    return RunMembers(run_dir, base, members, _read_chat_template(run_dir, config))


def select_members(members: list[EvalMember], spec: str) -> list[EvalMember]:
    """``all`` | ``students`` (solvers, incl. a baseline agent) | ``teachers`` | ``best`` (the trained solver with
    the highest rating mean mu, the score selection ranks by) | a comma-separated list of member ids."""
    spec = spec.strip()
    if spec == "all":
        return list(members)
    if spec in ("students", "teachers"):
        roles = SOLVER_ROLES if spec == "students" else ("teacher", "both")
        chosen = [m for m in members if m.role in roles]
        if not chosen:
            raise ValueError(f"--members {spec}: no member has role {' or '.join(roles)} (roles: "
                             f"{sorted({m.role for m in members})})")
        return chosen
    if spec == "best":
        rated = [m for m in members if m.role in SOLVER_ROLES and m.rating is not None and m.untrained is None]
        if not rated:
            raise ValueError("--members best needs solver ratings in population.json; none found. "
                             "Fix: name members explicitly, e.g. --members s0,s1")
        return [max(rated, key=lambda m: m.rating)]
    by_name = {m.name: m for m in members}
    wanted = [name.strip() for name in spec.split(",") if name.strip()]
    missing = [name for name in wanted if name not in by_name]
    if missing or not wanted:
        raise ValueError(f"--members: unknown member(s) {missing or spec!r}; the run has {', '.join(by_name)}")
    return [by_name[name] for name in wanted]


# -------------------------------------------------------------------------------------- adapter checks


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` of ``adapter_dir``; the weights file must exist beside it."""
    config_path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{config_path} not found: not a PEFT adapter directory") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc.msg})") from None
    if not isinstance(config, dict) or "r" not in config or "target_modules" not in config:
        raise ValueError(f"{config_path} lacks 'r' or 'target_modules': not a LoRA adapter config")
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise ValueError(f"{adapter_dir / 'adapter_model.safetensors'} not found (the adapter's weights)")
    return config


def same_model(a: str, b: str) -> bool:
    """Same model name or path, the same directory, or (a run copied between machines or caches) the same
    final path component."""
    if a == b:
        return True
    if os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b):
        return True
    return Path(a.rstrip("/")).name == Path(b.rstrip("/")).name


def check_adapters(members: list[EvalMember], base_model: str) -> dict[str, Any]:
    """Check that every adapter is a LoRA of ``base_model`` with one shared rank, alpha and target set.

    Returns the shared ``{"r", "lora_alpha", "target_modules"}`` (None when only the base is evaluated).
    """
    shared: dict[str, Any] | None = None
    first = ""
    for member in members:
        if member.adapter_dir is None:
            continue
        config = read_adapter_config(member.adapter_dir)
        where = member.adapter_dir / "adapter_config.json"
        trained_on = config.get("base_model_name_or_path")
        if trained_on and not same_model(str(trained_on), base_model):
            raise ValueError(f"{where}: adapter {member.name!r} was trained on base model {trained_on!r}, but the "
                             f"evaluation base is {base_model!r}. Fix: pass --base-model {trained_on} (or drop "
                             "that member).")
        targets = config["target_modules"]
        this = {"r": int(config["r"]), "lora_alpha": config.get("lora_alpha", config["r"]),
                "target_modules": sorted(targets) if isinstance(targets, list) else targets}
        if shared is None:
            shared, first = this, member.name
        elif this != shared:
            raise ValueError(f"{where}: adapter {member.name!r} has {this} but {first!r} has {shared}; one engine "
                             "holds adapters of one rank, alpha and target set. Fix: evaluate them in separate runs.")
    return shared or {}


def check_model_dir(model_dir: Path) -> None:
    """Check that ``model_dir`` is a full HF causal-LM directory: ``config.json`` naming a model type, weights
    (``*.safetensors`` or ``*.bin``) and tokenizer files; a PEFT adapter directory is refused."""
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir} does not exist or is not a directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        hint = (" (it holds adapter_config.json: a PEFT adapter, pass it as --adapter NAME=DIR)"
                if (model_dir / "adapter_config.json").is_file() else "")
        raise ValueError(f"{config_path} not found: not an HF model directory{hint}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise ValueError(f"{config_path} names no model_type or architectures: not an HF model config")
    if not _weight_files(model_dir):
        raise ValueError(f"{model_dir} holds no model weights (*.safetensors or *.bin): not an HF model directory")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{model_dir} has no tokenizer (tokenizer.json or tokenizer_config.json): save the "
                         "tokenizer beside the model (OpenRLHF's save_model does)")


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir()
                  if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith(("adapter_", "training_")))


def model_digest(model_dir: Path) -> str:
    """SHA-256 over a full model's weights, config and tokenizer files (name and content of each):
    detects a changed model on resume. Prefixed ``model:`` so it never equals an adapter's digest."""
    digest = hashlib.sha256()
    files = _weight_files(model_dir) + [model_dir / n for n in MODEL_FILES if (model_dir / n).is_file()]
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        _hash_file_into(digest, path)
        digest.update(b"\0")
    return "model:" + digest.hexdigest()


def member_digest(member: EvalMember) -> str:
    """What ``settings.json`` records for a member: its full model's or its adapter's digest ('base': none)."""
    return model_digest(member.model_dir) if member.model_dir is not None else adapter_digest(member.adapter_dir)


def adapter_digest(adapter_dir: Path | None) -> str:
    """SHA-256 of the adapter's weights file ('base' for the base model): detects changed adapters on resume."""
    if adapter_dir is None:
        return BASE_MEMBER
    digest = hashlib.sha256()
    _hash_file_into(digest, adapter_dir / "adapter_model.safetensors")
    return digest.hexdigest()


def _hash_file_into(digest, path: Path) -> None:
    """Feed ``path``'s bytes to ``digest``, 1 MiB at a time."""
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
