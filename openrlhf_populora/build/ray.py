"""The Ray engine's composition: OpenRLHF 0.11.2's own ``train_ppo_ray`` with the plugin's classes swapped in.

It owns the arguments (upstream's parser, the ``--populora.*`` group, the refusals), the mapping of upstream's
arguments to the loop's ``Config`` (:func:`config_from_args`) and the run function the trainer calls
(:func:`run_selfplay`, named in ``args.populora.runner``). The engine modules (``engines/ray/``) know none of the
loop; ``cli/ray_launch.py`` parses the command line through :func:`parse_launch_args` and launches.

Upstream builds its parser, validates the arguments and calls ``train(args)`` all inside
``if __name__ == "__main__":`` of ``openrlhf/cli/train_ppo_ray.py``, so none of it is importable. Instead of
copying any of it, this module runs that file with :func:`runpy.run_module` as ``__main__``, twice over:

1. :func:`upstream_parser` runs it under a scoped ``argparse.ArgumentParser.parse_args`` hook that raises a
   private exception carrying the parser, which stops the run right after the parser is built.
2. :func:`run_upstream` runs it again, with the plugin's classes swapped in (:func:`plugin_patches`), under a
   hook that answers ``parse_args`` with the namespace :func:`parse_launch_args` parsed (upstream's flags plus the
   ``--populora.*`` group, the plugin's defaults and refusals). From there on everything is upstream's: its
   validation, placement groups, actor groups, init order, ``fit`` and final save.

Where each swap must land, so that the runpy'd ``train()`` picks it up (read from the 0.11.2 source):

- ``openrlhf.trainer.ppo_trainer:PPOTrainer``: ``train()`` imports it *inside the function*
  (``from openrlhf.trainer.ppo_trainer import PPOTrainer``), so the module attribute at call time counts.
- ``openrlhf.trainer.ray.ppo_actor:PolicyModelActor``: ``train_ppo_ray`` imports it at module top level; the
  runpy'd module executes that import afresh, after the swap, so its ``train()`` sees the replacement.
- ``openrlhf.trainer.ray.vllm_engine:RolloutRayActor``: ``train()`` calls ``create_vllm_engines`` (imported at top
  level from ``openrlhf.trainer.ray``, the function object itself), which looks its module global
  ``RolloutRayActor`` up at call time. Swapping ``create_vllm_engines`` is not needed.

The swaps only change what the driver process instantiates; the replacement classes are importable modules, so
Ray workers load them by reference. :func:`run_upstream` reverts every swap when it returns or raises.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import functools
import os
import runpy
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import yaml

from openrlhf_populora.config import Config, PopuLoRAConfig, add_flag, iter_fields, preset_layers, set_dotted
from openrlhf_populora.engines.vllm_targets import vllm_lora_targets
from openrlhf_populora.errors import InputError
from openrlhf_populora.launch_checks import engines_per_node, tensor_parallel_fits
from openrlhf_populora.patches import openrlhf_0_11_2 as patches
from openrlhf_populora.patches.openrlhf_0_11_2.cpu import install_flash_attn_shim

UPSTREAM_MODULE = "openrlhf.cli.train_ppo_ray"
PROG = "python -m openrlhf_populora.cli.train --populora.engine ray"

# ``--reward.remote_url`` default: any non-empty value stops upstream's train() from building a reward-model
# group; the plugin scores proposals and answers in its sandbox. Upstream splits it on commas -> ["populora"].
REWARD_SENTINEL = "populora"

# Upstream flags whose default the plugin changes; a flag the user passes wins.
PLUGIN_DEFAULTS: dict[str, Any] = {
    "algo.advantage.estimator": "reinforce",  # REINFORCE++ (AZR's TRR++ is its per-group variant)
    "algo.kl.init_coef": 0.0,  # AZR trains without KL; > 0 keeps upstream's reference actor group
    "reward.remote_url": REWARD_SENTINEL,
    "ckpt.path": "",  # empty: <ckpt.output_dir>/checkpoints, as in the local engine (upstream: ./ckpt/... in cwd)
}

CONFIG_DEST = "populora_config_file"  # --config; not forwarded to upstream

# (upstream target, replacement "module:attr", why). The replacements are imported lazily by plugin_patches().
SWAPS: tuple[tuple[str, str, str], ...] = (
    ("openrlhf.trainer.ppo_trainer:PPOTrainer",
     "openrlhf_populora.engines.ray.trainer:PopuLoRATrainer",
     "the controller: runs the self-play loop; train() imports PPOTrainer inside the function"),
    ("openrlhf.trainer.ray.ppo_actor:PolicyModelActor",
     "openrlhf_populora.engines.ray.policy_actor:PopuLoRAPolicyActor",
     "one DeepSpeed engine holding every adapter; train_ppo_ray imports it at module level (runpy re-imports)"),
    ("openrlhf.trainer.ray.vllm_engine:RolloutRayActor",
     "openrlhf_populora.engines.ray.vllm_rollout:MultiLoRARolloutActor",
     "vLLM with multi-LoRA; create_vllm_engines reads this module global at call time"),
)


def plugin_patches(replacements: Mapping[str, Any] | None = None) -> list[patches.Patch]:
    """The three class swaps of the Ray launch, as :class:`Patch` objects for :func:`patches.apply`.

    Each replacement is imported from its module now (not when this module is imported). ``replacements``
    maps a target (``"openrlhf.trainer.ppo_trainer:PPOTrainer"``) to an object used instead of the import,
    which lets tests register stand-ins.
    """
    replacements = replacements or {}
    unknown = set(replacements) - {target for target, _, _ in SWAPS}
    if unknown:
        raise KeyError(f"not a swap target of the Ray launch: {sorted(unknown)}")
    return [patches.Patch(target, replacements[target] if target in replacements else patches.lookup(source), why)
            for target, source, why in SWAPS]


# ---------------------------------------------------------------------------------------------------------
# running upstream's __main__ under a parse_args hook


def _is_upstream_parser(parser: argparse.ArgumentParser) -> bool:
    options = parser._option_string_actions
    return "--actor.model_name_or_path" in options and "--vllm.num_engines" in options


@contextlib.contextmanager
def _parse_args_hook(answer: Callable[[argparse.ArgumentParser], Any]) -> Iterator[list[bool]]:
    """While active, the first ``parse_args`` call on upstream's parser returns ``answer(parser)`` (or raises what
    it raises) and the hook removes itself; other parsers parse normally. Yields ``[called]``."""
    original = argparse.ArgumentParser.parse_args
    called = [False]

    def hooked(self, args=None, namespace=None):
        if not _is_upstream_parser(self):
            return original(self, args, namespace)
        argparse.ArgumentParser.parse_args = original
        called[0] = True
        return answer(self)

    argparse.ArgumentParser.parse_args = hooked
    try:
        yield called
    finally:
        argparse.ArgumentParser.parse_args = original


def _run_upstream_main() -> None:
    with warnings.catch_warnings():
        # runpy warns when the module was already imported (e.g. by the source-hash lock); harmless here
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module(UPSTREAM_MODULE, run_name="__main__", alter_sys=False)


class _ParserCaptured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("upstream parser captured")
        self.parser = parser


@functools.cache
def _captured_parser() -> argparse.ArgumentParser:
    def capture(parser: argparse.ArgumentParser):
        raise _ParserCaptured(parser)

    # upstream's modules import flash_attn at the top; without the real package (CPU machines) a shim that
    # refuses every call stands in (it changes nothing where flash_attn imports)
    install_flash_attn_shim()
    try:
        with _parse_args_hook(capture):
            _run_upstream_main()
    except _ParserCaptured as captured:
        return captured.parser
    raise RuntimeError(f"{UPSTREAM_MODULE} ran to the end without calling parse_args on its parser")


def upstream_parser() -> argparse.ArgumentParser:
    """OpenRLHF 0.11.2's ``train_ppo_ray`` parser (167 flags), captured from its ``__main__`` block.

    The capture runs once per process; each call returns a deep copy, free to modify.
    """
    return copy.deepcopy(_captured_parser())


# ---------------------------------------------------------------------------------------------------------
# the launch parser: upstream's flags + the --populora.* group


def add_populora_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config`` and the ``--populora.*`` group, generated from :class:`PopuLoRAConfig` with the local CLI's
    own helper, so both engines share flag names, types, choices and help. Defaults are ``SUPPRESS``: a flag
    the user did not pass is absent, and :func:`parse_launch_args` fills it from the preset or the dataclass."""
    group = parser.add_argument_group("PopuLoRA", "population self-play (the same --populora.* flags as the "
                                                  "local engine)")
    group.add_argument("--config", dest=CONFIG_DEST, default=None,
                       help="YAML preset; its populora: section gives the --populora.* defaults (flags win)")
    for name, f, tp in iter_fields(PopuLoRAConfig, "populora."):
        add_flag(group, name, f, tp)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Upstream's parser with the plugin's defaults (:data:`PLUGIN_DEFAULTS`) and the ``--populora.*`` group."""
    parser = upstream_parser()
    parser.prog = PROG
    parser.set_defaults(**PLUGIN_DEFAULTS)
    return add_populora_flags(parser)


def _error_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    known = list(parser._option_string_actions)
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    for token in extras:
        flag = token.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                lines.append(f"{flag} -> did you mean {close[0]}?")
    parser.error("\n  ".join(lines))


# upstream flags whose job the plugin does another way (its controller never reads them): setting one is refused,
# naming what to use instead, rather than silently ignored
NOT_READ: dict[str, str] = {
    "rollout.n_samples_per_prompt": "--populora.solver_samples (answers per task)",
    "rollout.batch_size": "--populora.proposals_per_teacher and --populora.solver_tasks",
    "train.num_episodes": "--populora.total_steps",
    "data.apply_chat_template": "--populora.chat_template",
    "algo.dynamic_filtering_enable": "--populora.skip_zero_advantage (leaves zero-advantage samples out)",
    "algo.dynamic_filtering_range": "--populora.skip_zero_advantage",
    **{f"data.{name}": "nothing: the teachers write the tasks" for name in (
        "prompt_dataset", "prompt_probs", "prompt_split", "input_key", "label_key", "input_template",
        "max_samples")},
    **{f"eval.{name}": "python -m openrlhf_populora.cli.evaluate --run RUN_DIR after training" for name in (
        "dataset", "steps", "split", "n_samples_per_prompt", "temperature")},
    "reward.model_name_or_path": "nothing: rewards come from the sandboxed verifier",
    "reward.remote_url": "nothing: rewards come from the sandboxed verifier",
    "train.partial_rollout_enable": "nothing: generation and training run in lockstep",
    "ckpt.save_hf": "nothing: every member's adapter is written in PEFT format to <ckpt.output_dir>/adapters/ "
                    "at every checkpoint and at the end (PeftModel.from_pretrained, vLLM --lora-modules)",
}


def _refusals(flat: argparse.Namespace, defaults: Mapping[str, Any]) -> list[str]:
    """Why the PopuLoRA Ray engine cannot run these upstream settings (empty: it can). ``defaults``: the
    parser's default of every destination (a flag of :data:`NOT_READ` that differs from it was set)."""
    get = functools.partial(getattr, flat)
    reasons = [f"--{dest} is not read by the PopuLoRA Ray engine; use {instead}"
               for dest, instead in NOT_READ.items() if get(dest) != defaults[dest]]
    if get("train.async_enable"):
        reasons.append("--train.async_enable is not supported: the self-play step needs generation and training "
                       "in lockstep")
    if get("ds.packing_samples") or get("train.dynamic_batch_enable") or get("ds.ring_attn_size") > 1:
        reasons.append("--ds.packing_samples (also implied by --train.dynamic_batch_enable and "
                       "--ds.ring_attn_size > 1) is not supported: a packed micro-batch would mix adapters")
    if get("algo.advantage.estimator") == "gae":
        reasons.append("--algo.advantage.estimator gae needs a critic per adapter, which is not supported; use "
                       "reinforce (the default here) or reinforce_baseline")
    if not get("vllm.num_engines"):
        reasons.append("--vllm.num_engines must be >= 1: generation is vLLM-only (with --train.colocate_all, "
                       "engines x --vllm.tensor_parallel_size = actor GPUs)")
    if get("ds.lora.rank") <= 0:
        reasons.append("--ds.lora.rank must be > 0: every population member is a LoRA adapter (e.g. 16)")
    if get("train.agent_func_path"):
        reasons.append("--train.agent_func_path is not supported: the plugin writes its own prompts and rewards")
    # accepted by upstream, then broken in the plugin's engine: refused here rather than crashing mid-run
    if get("vllm.enable_sleep"):
        reasons.append("--vllm.enable_sleep is not supported: upstream puts every engine to sleep after creating "
                       "it and only its own generator and weight broadcast wake them; the plugin replaces both, so "
                       "generation would wait forever (and a LoRA upload would write into offloaded memory)")
    if get("ds.enable_sleep"):
        reasons.append("--ds.enable_sleep is not supported: DeepSpeed's offload_states drops the fp32 master "
                       "fragments the adapter uploads read under ZeRO-1/2 (the first upload fails)")
    if get("algo.advantage.is_correction_level") != "off":
        reasons.append("--algo.advantage.is_correction_level is not supported: the plugin's experiences carry no "
                       "vLLM rollout log-probs for the importance-sampling correction (leave it off)")
    if get("ds.tensor_parallel_size") > 1:
        reasons.append("--ds.tensor_parallel_size > 1 (DeepSpeed AutoTP) is not supported: the adapters' "
                       "data-parallel dealing and gathers assume every rank is a data-parallel rank")
    if get("train.colocate_all"):  # the engines take the actor's GPUs, node by node
        fits = tensor_parallel_fits(get("actor.num_gpus_per_node"), get("vllm.tensor_parallel_size"))
        if not fits.ok:
            reasons.append(f"--vllm.tensor_parallel_size {get('vllm.tensor_parallel_size')} does not divide "
                           f"--actor.num_gpus_per_node {get('actor.num_gpus_per_node')}: {fits.message()}")
    if get("ds.zero_stage") == 3 and get("ds.adam_offload"):
        reasons.append("--ds.adam_offload is not supported with --ds.zero_stage 3: the per-adapter optimizer "
                       "windows read and restore the optimizer's partitions on the device (use ZeRO-2 with "
                       "--ds.adam_offload, or ZeRO-3 without it)")
    try:  # vLLM serves LoRA only on the layers the adapters train (its lora_target_modules)
        vllm_lora_targets(get("ds.lora.target_modules"))
    except ValueError as err:
        reasons.append(str(err))
    return reasons


def adapter_names(populora: PopuLoRAConfig) -> list[str]:
    """The fixed adapter slots of a run: teachers ``t0..``, students ``s0..``; the baseline's one slot ``b0``."""
    from openrlhf_populora.population.members import Population

    if populora.mode == "baseline":
        population = Population.baseline()
    else:
        population = Population.create(populora.num_teachers, populora.num_students)
    return [member.adapter for member in population.alive()]


RUNNER = "openrlhf_populora.build.ray:run_selfplay"  # what the trainer's fit runs (args.populora.runner)
RUNNER_ENV = "POPULORA_RAY_RUNNER"  # "module:function" replacing it, e.g. a scripted engine for tests and demos

# Leaves of ``Config`` the loop reads from upstream's arguments (the engine-side leaves -- optimiser, LoRA shape,
# dtype -- are consumed by upstream's actors).
# the model and the LoRA shape too: the loop's learning probe reads the base weights and the LoRA scaling
SHARED_PREFIXES = ("populora.", "rollout.", "train.seed", "train.max_epochs", "ckpt.", "logger.",
                   "actor.model_name_or_path", "ds.lora.rank", "ds.lora.alpha")

_MISSING = object()


def _lookup(namespace: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        namespace = getattr(namespace, part, _MISSING)
        if namespace is _MISSING:
            return _MISSING
    return namespace


def config_from_args(args: Any) -> Config:
    """A validated ``Config`` for the self-play loop from upstream's hierarchized ``args``: every leaf the two
    share (``rollout.temperature``, ``train.seed``, ``ckpt.output_dir``, ``logger.*``, ``populora.*`` ...)."""
    config = Config()
    for name, _field, _tp in iter_fields(Config):
        if not name.startswith(SHARED_PREFIXES):
            continue
        value = _lookup(args, name)
        if value is _MISSING or value is None:
            continue
        if name == "ckpt.save_steps" and value == float("inf"):  # upstream turns -1 into inf
            value = -1
        if name.startswith("logger.wandb.") and not _lookup(args, "logger.wandb.key"):
            continue  # upstream's rule: W&B is on only with --logger.wandb.key (its project has a default)
        if name == "ckpt.max_num":
            value = int(value)
        set_dotted(config, name, value)
    config.validate()
    return config


def run_selfplay(args: Any, engine: Any) -> int:
    """The Ray trainer's ``fit``: the self-play run (directory, loop, checkpoints) on the trainer's engine."""
    from openrlhf_populora.selfplay.runner import claim_run_dir, run

    config = config_from_args(args)
    lock = claim_run_dir(config)  # noqa: F841 - held (the run directory locked) until the run returns
    return run(config, lambda _config: engine, progress=True)


def populora_namespace(populora: PopuLoRAConfig) -> SimpleNamespace:
    """The ``--populora.*`` values as nested namespaces (``args.populora.evolution.evolve_every``), as upstream's
    ``hierarchize`` builds them, plus ``adapter_names`` (the run's fixed adapter slots)."""
    root = SimpleNamespace()
    for name, _field, _tp in iter_fields(PopuLoRAConfig):
        *parents, leaf = name.split(".")
        node, value = root, populora
        for part in parents:
            if not hasattr(node, part):
                setattr(node, part, SimpleNamespace())
            node, value = getattr(node, part), getattr(value, part)
        setattr(node, leaf, copy.deepcopy(getattr(value, leaf)))
    root.adapter_names = adapter_names(populora)
    root.runner = os.environ.get(RUNNER_ENV, RUNNER)
    return root


# The algorithm's knobs, which both engines take from one tree (``Config``'s defaults, then the preset, then
# flags): Config leaf -> upstream destination. Everything else upstream owns (topology, DeepSpeed, vLLM).
ALGORITHM_LEAVES: dict[str, str] = {
    **{leaf: leaf for leaf in (
        "actor.adam.lr", "actor.adam.betas", "actor.adam.eps", "actor.adam.weight_decay", "actor.lr_scheduler",
        "actor.lr_warmup_ratio", "actor.min_lr_ratio", "actor.max_norm", "actor.eps_clip",
        "actor.eps_clip_low_high", "actor.entropy_coef", "ds.lora.rank", "ds.lora.alpha", "ds.lora.target_modules",
        "ds.lora.dropout", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "train.seed",
        "train.max_epochs")},
    "actor.micro_batch_size": "train.micro_batch_size",
}
# preset leaves upstream has under the same name, taken from a preset but left at upstream's defaults otherwise
PRESET_ONLY_LEAVES = ("actor.model_name_or_path", "ds.param_dtype", "ds.attn_implementation", "ckpt.output_dir",
                      "ckpt.save_steps",
                      "ckpt.max_num", "logger.logging_steps", "logger.tensorboard_dir")


def upstream_value(leaf: str, value: Any) -> Any:
    """A Config leaf's value as upstream's flag means it: the local engine's ``constant`` schedule has a linear
    warm-up (HF's ``constant_with_warmup``), an entropy coefficient of 0 is upstream's None (not computed)."""
    if leaf == "actor.lr_scheduler" and value == "constant":
        return "constant_with_warmup"
    if leaf == "actor.entropy_coef" and value == 0:
        return None
    if isinstance(value, tuple):
        return list(value)
    return value


def _preset_defaults(argv: Sequence[str], cuda: bool) -> tuple[dict[str, Any], list[str]]:
    """Upstream flag defaults from the one tree: ``Config``'s algorithm defaults, then the preset's values
    (``--config`` and a matched baseline's population preset). Returns them and the preset leaves upstream
    has no use for."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--config", default=None)
    probe.add_argument("--populora.baseline_for", dest="baseline_for", default=None)
    known, _ = probe.parse_known_args(list(argv))
    flags = {"populora.baseline_for": known.baseline_for} if known.baseline_for else {}
    config = Config()
    defaults = {dest: upstream_value(leaf, _lookup(config, leaf)) for leaf, dest in ALGORITHM_LEAVES.items()}
    unused = []
    for layer in preset_layers(known.config, flags):
        for leaf, value in layer.items():
            if leaf.startswith("populora."):
                continue
            if leaf in ALGORITHM_LEAVES:
                defaults[ALGORITHM_LEAVES[leaf]] = upstream_value(leaf, value)
            elif leaf == "ds.param_dtype" and value == "auto":
                defaults[leaf] = "bf16" if cuda else "fp32"
            elif leaf in PRESET_ONLY_LEAVES:
                defaults[leaf] = value
            else:
                unused.append(leaf)
    return defaults, sorted(unused)


def requested_cluster_device(argv: Sequence[str]) -> str:
    """``--populora.cluster_device`` as given on the command line (``auto`` when absent)."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--populora.cluster_device", dest="device", default="auto")
    return probe.parse_known_args(list(argv))[0].device


def parse_launch_args(argv: Sequence[str], cpu: bool | None = None) -> SimpleNamespace:
    """Parse a Ray-engine command line into upstream's hierarchized namespace with ``args.populora`` attached.

    Runs argparse (upstream's flags and types, the plugin's defaults, the ``--populora.*`` group and its preset),
    the PopuLoRA validation and the plugin's refusals. Errors exit with status 2 and a message, like argparse.
    Upstream's own validation runs later, inside :func:`run_upstream`. ``cpu``: whether the GPU workers are CPUs
    (the CPU defaults apply); None: judged from ``--populora.cluster_device`` and this process
    (:func:`cluster.planned_cpu`); the launch (``cli/ray_launch.py``) parses again with the answer of the cluster
    it joins.
    Paths (``ckpt.output_dir``, ``ckpt.path``, ``logger.tensorboard_dir``) come back absolute, resolved in
    this process's working directory: Ray's workers on other nodes run in other directories.
    """
    from openrlhf.utils.config import hierarchize

    from openrlhf_populora.engines.ray import cluster

    parser = build_parser()
    if cpu is None:
        cpu = cluster.planned_cpu(requested_cluster_device(argv))
    cuda = not cpu
    if not cuda:
        parser.set_defaults(**cluster.CPU_DEFAULTS)
    try:
        defaults, unused = _preset_defaults(argv, cuda)
    except (ValueError, yaml.YAMLError) as err:
        parser.error(str(err))
    parser.set_defaults(**defaults)
    if unused:
        print(f"[populora] the Ray engine has no use for these preset settings: {', '.join(unused)}", file=sys.stderr)
    flat, extras = parser.parse_known_args(list(argv))
    if extras:
        _error_unknown(parser, extras)
    if not cuda:  # common.args names flash-attn for the GPUs; transformers refuses it without CUDA
        attention = getattr(flat, "ds.attn_implementation")
        if cluster.cpu_attention(attention) != attention:
            setattr(flat, "ds.attn_implementation", cluster.cpu_attention(attention))
            print(f"[populora] GPU workers on CPU: --ds.attn_implementation {attention} needs CUDA; using "
                  f"{cluster.cpu_attention(attention)}", file=sys.stderr)
    if getattr(flat, "populora.engine", "ray") != "ray":
        parser.error(f"--populora.engine {getattr(flat, 'populora.engine')}: this launcher runs the ray engine")
    config = Config()
    try:
        preset = getattr(flat, CONFIG_DEST)
        flags = {name: getattr(flat, name) for name in vars(flat) if name.startswith("populora.")}
        layers = preset_layers(preset, flags)  # a matched baseline's population preset, then --config
        for layer in [*layers, flags]:
            for name, value in layer.items():
                if name.startswith("populora."):
                    set_dotted(config, name, value)
        for name in flags:
            delattr(flat, name)
        config.populora.engine = "ray"
        config.validate()  # the local CLI's rules; every non-populora leaf here is a valid default
    except (ValueError, yaml.YAMLError) as err:
        parser.error(str(err))
    delattr(flat, CONFIG_DEST)
    reasons = _refusals(flat, {dest: parser.get_default(dest) for dest in NOT_READ})
    if reasons:
        parser.error("the PopuLoRA Ray engine cannot run this:\n  " + "\n  ".join(reasons))
    args = hierarchize(flat)
    from openrlhf_populora.models.embedded import is_builtin_model, resolve_model

    if is_builtin_model(args.actor.model_name_or_path):  # "embedded", "tiny": this package's models, on disk
        args.actor.model_name_or_path = resolve_model(args.actor.model_name_or_path, for_vllm=True)
    args.ckpt.output_dir = os.path.abspath(args.ckpt.output_dir)
    args.ckpt.path = os.path.abspath(args.ckpt.path or os.path.join(args.ckpt.output_dir, "checkpoints"))
    if args.logger.tensorboard_dir:
        args.logger.tensorboard_dir = os.path.abspath(args.logger.tensorboard_dir)
    if args.ds.lora.target_modules == ["all-linear"]:
        # upstream's default is the string "all-linear", which peft expands to every linear layer; passed as a
        # flag it arrives as the list ["all-linear"], which peft takes as a module name and fails on
        args.ds.lora.target_modules = "all-linear"
    args.populora = populora_namespace(config.populora)
    return args


# ---------------------------------------------------------------------------------------------------------
# the launch


def launch_swaps(args: SimpleNamespace) -> list[patches.Patch]:
    """The class swaps, with the rollout actor configured for vLLM's LoRA slots (one per adapter, ranks up to
    ``--ds.lora.rank``, on the layers of ``--ds.lora.target_modules`` only) and told how many engines share a
    node's adapter directory."""
    from openrlhf_populora.engines.ray import vllm_rollout

    per_node = engines_per_node(args.vllm.num_engines, args.vllm.tensor_parallel_size, args.actor.num_gpus_per_node)
    rollout_actor = vllm_rollout.configure_multilora(max_loras=len(args.populora.adapter_names),
                                                     max_lora_rank=args.ds.lora.rank,
                                                     target_modules=args.ds.lora.target_modules,
                                                     engines_per_node=per_node)
    return plugin_patches({"openrlhf.trainer.ray.vllm_engine:RolloutRayActor": rollout_actor})


def upstream_validation_failed(err: AssertionError) -> bool:
    """True when the assertion fired in ``train_ppo_ray``'s ``__main__`` block (its argument validation), not in
    ``train()`` or deeper."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    code = tb.tb_frame.f_code
    return code.co_name == "<module>" and code.co_filename.endswith(os.path.join("cli", "train_ppo_ray.py"))


def run_upstream(args: SimpleNamespace, swaps: list[patches.Patch]) -> None:
    """Apply ``swaps``, run upstream's ``__main__`` (validation, then ``train(args)``) answering its ``parse_args``
    with ``args``, and revert every patch, whatever happens."""
    patches.apply(swaps)
    try:
        with _parse_args_hook(lambda _parser: args) as called:
            _run_upstream_main()
        if not called[0]:
            raise RuntimeError(f"{UPSTREAM_MODULE} ran without calling parse_args; nothing was launched")
    finally:
        patches.revert()


def run_on_ray(args: SimpleNamespace, planned_cpu: bool, reparse: Callable[[bool], SimpleNamespace],
               swaps: Callable[[SimpleNamespace, bool], list[patches.Patch]], **connect: Any) -> None:
    """Join the running cluster, or start a local CPU Ray, or leave Ray to upstream (``engines/ray/cluster.py``;
    ``connect``: its options), then :func:`run_upstream`. ``args`` was parsed for ``planned_cpu`` workers; when
    the workers turn out otherwise, ``reparse(cpu)`` parses again with their defaults. ``swaps(args, cpu)``: the
    patches to apply. A Ray this started is shut down at the end. Raises :class:`InputError` when upstream's
    argument validation refuses ``args``."""
    from openrlhf_populora.engines.ray import cluster

    ray_launch = cluster.connect(args, **connect)
    try:
        if ray_launch.cpu != planned_cpu:
            args = reparse(ray_launch.cpu)  # the defaults of what the workers really are
        print(f"[populora] Ray: {ray_launch.address or 'local'}, GPU workers on "
              f"{'CPU (logical GPUs)' if ray_launch.cpu else 'CUDA'}", file=sys.stderr)
        run_upstream(args, swaps(args, ray_launch.cpu))
    except AssertionError as err:
        if not upstream_validation_failed(err):
            raise
        raise InputError(f"{err} (OpenRLHF's argument validation)") from None
    finally:
        if ray_launch.initialized:
            import ray

            ray.shutdown()
