"""The outer loop of a run: set-up or resume, steps with a progress bar, checkpoints, Ctrl-C, final save.

``SelfPlay`` (loop.py) knows one step; this module knows a run: where files go, when to checkpoint, how
to stop cleanly. It is the same for every engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from openrlhf_populora.config import Config, config_from_dict
from openrlhf_populora.metrics import Tracker, progress_postfix
from openrlhf_populora.selfplay.checkpoint import latest_checkpoint, save_checkpoint
from openrlhf_populora.selfplay.loop import SelfPlay
from openrlhf_populora.selfplay.summary import problem_records, step_metrics

log = logging.getLogger(__name__)


class RunDirError(ValueError):
    """The run directory cannot be used as asked (entry points report it with exit status 2)."""


def check_run_dir(config: Config) -> None:
    """Refuse what would lose or corrupt a run, before anything is written: an existing run without
    ``--ckpt.load_enable``, and a resume of a run that has steps but no checkpoint (its steps would repeat).
    ``--ckpt.load_enable`` on a directory without a run starts a new one (what a preemptible job's command
    line, which always asks to resume, needs on its first start)."""
    run_dir = Path(config.ckpt.output_dir)
    has_run = (run_dir / "metrics.jsonl").exists()
    if has_run and not config.ckpt.load_enable:
        raise RunDirError(f"{run_dir} already holds a run (metrics.jsonl). Resume it with --ckpt.load_enable, "
                          f"or choose another --ckpt.output_dir.")
    if has_run and latest_checkpoint(config.checkpoint_dir) is None:
        raise RunDirError(f"--ckpt.load_enable: {run_dir} holds a run (metrics.jsonl) but no checkpoint under "
                          f"{config.checkpoint_dir}, so it cannot be resumed exactly; start it again in another "
                          f"--ckpt.output_dir (or delete this one).")


def _lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on the run directory for this process's lifetime: two runs writing into the
    same directory would interleave their metrics and checkpoints."""
    import fcntl

    handle = open(run_dir / ".lock", "w")  # noqa: SIM115 - kept open on purpose, released at exit
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: another run is writing into {run_dir} right now; wait for it or choose "
                         f"another --ckpt.output_dir") from None
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _write_config(config: Config, run_dir: Path) -> None:
    path = run_dir / "config.yaml"
    if path.exists():  # resuming: keep the original next to the new one
        previous = config_from_dict(yaml.safe_load(path.read_text()))
        if previous.to_dict() != config.to_dict():
            shutil.copy(path, run_dir / f"config.{int(time.time())}.yaml")
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def claim_run_dir(config: Config):
    """Make the run directory this process's: refuse an existing run unless resuming (:func:`check_run_dir`),
    lock it, write the resolved ``config.yaml``. Every entry point calls this before :func:`run`; keep the
    returned handle open for the run's lifetime (closing it releases the lock)."""
    check_run_dir(config)
    run_dir = Path(config.ckpt.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = _lock_run_dir(run_dir)
    _write_config(config, run_dir)
    return handle


def _make_tracker(config: Config, run_dir: Path) -> Tracker:
    wandb = None
    w = config.logger.wandb
    if w.project or w.key:
        wandb = {"project": w.project or "openrlhf_populora", "entity": w.org, "group": w.group,
                 "name": w.run_name or run_dir.name, "mode": w.mode, "key": w.key,
                 "config": config.to_dict()}
    meta = {"mode": config.populora.mode, "label": run_dir.name}
    return Tracker(run_dir, tensorboard_dir=config.logger.tensorboard_dir, wandb=wandb, meta=meta,
                   logging_steps=config.logger.logging_steps)


def _export(loop: SelfPlay, run_dir: Path) -> None:
    """The run directory's human-facing files: adapters in PEFT format, population, buffers."""
    adapters = run_dir / "adapters"
    adapters.mkdir(exist_ok=True)
    for member in loop.population.members:  # a member retired since an earlier export (a resumed run) goes
        if not member.alive:
            shutil.rmtree(adapters / member.id, ignore_errors=True)
    for member in loop.population.alive():
        loop.engine.save_adapter(member.adapter, str(adapters / member.id))
    loop.population.snapshot_ratings(loop.ratings)
    loop.population.save(run_dir / "population.json")
    loop.buffers.save(run_dir / "buffers.jsonl")


def run(config: Config, build_engine: Callable[[Config], Any], sandbox_factory: Callable[[], Any] | None = None,
        progress: bool = True) -> int:
    """Run (or resume) the configured self-play run. Returns a process exit status."""
    from openrlhf_populora.sandbox import Sandbox

    run_dir = Path(config.ckpt.output_dir)
    ckpt_root = config.checkpoint_dir
    sb_cfg = config.populora.sandbox
    sandbox_factory = sandbox_factory or (lambda: Sandbox(workers=sb_cfg.workers, timeout_s=sb_cfg.timeout_s,
                                                          memory_mb=sb_cfg.memory_mb,
                                                          isolation=sb_cfg.isolation))
    engine = build_engine(config)
    tracker = _make_tracker(config, run_dir)
    interrupted = False

    def on_sigterm(signum, frame):  # treat a scheduler's SIGTERM like Ctrl-C: checkpoint, then stop
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with sandbox_factory() as sandbox:
            loop = SelfPlay(config, engine, sandbox, run_dir, tracker)
            checkpoint = latest_checkpoint(ckpt_root) if config.ckpt.load_enable else None
            if checkpoint is not None:
                loop.load_state(checkpoint)
                tracker.truncate_after(loop.step)
                log.info("resumed from %s at step %d", checkpoint, loop.step)
            else:
                if config.ckpt.load_enable:  # check_run_dir refused a run with steps but no checkpoint
                    log.info("--ckpt.load_enable: nothing to resume in %s, starting a new run", run_dir)
                loop.create_adapters()
                tic = time.perf_counter()
                sizes = loop.seed_buffers()
                tracker.log_event(0, {"kind": "seeding", "buffer_sizes": sizes,
                                      "seconds": time.perf_counter() - tic})

            def checkpoint_now() -> None:
                save_checkpoint(ckpt_root, loop.step, loop.save_state, max_num=config.ckpt.max_num)

            bar = tqdm(total=config.populora.total_steps, initial=loop.step, disable=not progress,
                       desc="self-play", unit="step", dynamic_ncols=True)
            loop.on_phase = lambda phase: bar.set_description(f"self-play [{phase}]")
            try:
                while loop.step < config.populora.total_steps:
                    output = loop.run_step()
                    metrics = step_metrics(loop, output)
                    tracker.log(output.step, metrics)
                    tracker.log_problems(output.step, problem_records(output))
                    for event in output.evolution:
                        tracker.log_event(output.step, {"kind": "evolution", **event})
                    bar.update(1)
                    bar.set_postfix(progress_postfix(metrics))
                    if output.step % config.logger.logging_steps == 0:
                        log.info("step %d: %s", output.step, _one_line(metrics))
                    if config.ckpt.save_steps > 0 and loop.step % config.ckpt.save_steps == 0:
                        checkpoint_now()
            except KeyboardInterrupt:
                interrupted = True
                log.warning("interrupted at step %d: writing a checkpoint", loop.step)
            finally:
                bar.close()
            if loop.step > 0:
                checkpoint_now()
            _export(loop, run_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
        tracker.close()
        engine.close()
    if interrupted:
        log.warning("stopped early; resume with --ckpt.load_enable --ckpt.output_dir %s", run_dir)
        return 130
    if config.populora.report:
        from openrlhf_populora.metrics import render_report

        try:
            render_report([run_dir], run_dir / "figures")
        except Exception as err:  # figures are a convenience: never lose a finished run over them
            log.warning("could not render the figures (%s); run `python -m openrlhf_populora.cli.report %s`",
                        err, run_dir)
    log.info("done: %d steps in %s", loop.step, run_dir)
    return 0


def _one_line(metrics: dict[str, Any]) -> str:
    keys = ["train/solve_rate", "train/validity", "train/teacher_reward", "coverage/overall", "time/step"]
    return " ".join(f"{k.split('/')[-1]}={metrics[k]:.3g}" for k in keys if isinstance(metrics.get(k), float))
