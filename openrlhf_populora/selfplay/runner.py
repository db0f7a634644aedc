"""The outer loop of a run: set-up or resume, steps with a progress bar, checkpoints, signals, errors, final save.

``SelfPlay`` (loop.py) knows one step; this module knows a run: where files go, when to checkpoint, how
to stop cleanly. It is the same for every engine. A study that runs self-play of its own (``studies/``) uses it
through ``run_on`` (an engine the study owns) and ``RunHooks`` (its own start, a last step, hooks).

A step is atomic. The loop changes its state (adapters, optimizer states, buffers, ratings, population) all
through a step and moves its counter at the end, so a state caught mid-step is half-applied and must never be
saved. Hence:

- **SIGTERM / SIGINT** (a scheduler's preemption, Ctrl-C) are deferred: the handler notes the signal, the step in
  progress (or the seeding) finishes and is logged, the run checkpoints it and stops with status 130. A second
  signal stops at once (``KeyboardInterrupt``) without saving: the run stays at its last checkpoint.
- **An exception** in any phase stops the run at its last checkpoint, which only ever holds whole steps (every
  step on the laptop presets, ``--ckpt.save_steps`` on the others, and always the seeded state at step 0), with
  one line saying what failed and how to resume (``RunFailed``); the traceback goes to ``error.log``.

A resume (``--ckpt.load_enable``) loads the last checkpoint and forgets the records logged after it, so it
equals an uninterrupted run bit for bit.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from openrlhf_populora.config import (
    MAY_CHANGE_ON_RESUME_HELP,
    Config,
    config_differences,
    config_from_dict,
    resume_conflicts,
)
from openrlhf_populora.dirlock import DirectoryBusy, DirectoryLock, claim_directory
from openrlhf_populora.durable import replace_text
from openrlhf_populora.metrics import Tracker, progress_postfix
from openrlhf_populora.metrics.provenance import provenance
from openrlhf_populora.selfplay.checkpoint import latest_checkpoint, save_checkpoint
from openrlhf_populora.selfplay.loop import SelfPlay, StepOutput
from openrlhf_populora.selfplay.summary import problem_records, step_metrics

log = logging.getLogger(__name__)


class RunDirError(ValueError):
    """The run directory cannot be used as asked (entry points report it with exit status 2)."""


class RunFailed(RuntimeError):
    """A phase of the run raised (``__cause__``); the run stays at its last checkpoint. ``str()`` is the one-line
    report: where it failed, the step it can resume from, and how."""


def check_run_dir(config: Config) -> None:
    """Refuse what would lose or corrupt a run, before anything is written: an existing run without
    ``--ckpt.load_enable``, a resume of a run that has steps but no checkpoint (its steps would repeat), and a
    resume whose configuration differs from the run's ``config.yaml`` in a key that changes what the run computes
    (``config.resume_conflicts``). ``--ckpt.load_enable`` on a directory without a run starts a new one (what a
    preemptible job's command line, which always asks to resume, needs on its first start)."""
    run_dir = Path(config.ckpt.output_dir)
    has_run = (run_dir / "metrics.jsonl").exists()
    checkpoint = latest_checkpoint(config.checkpoint_dir)
    if (has_run or checkpoint is not None) and not config.ckpt.load_enable:
        raise RunDirError(f"{run_dir} already holds a run ({'metrics.jsonl' if has_run else 'a checkpoint'}). "
                          f"Resume it with --ckpt.load_enable, or choose another --ckpt.output_dir.")
    if has_run and checkpoint is None:
        raise RunDirError(f"--ckpt.load_enable: {run_dir} holds a run (metrics.jsonl) but no checkpoint under "
                          f"{config.checkpoint_dir}, so it cannot be resumed exactly; start it again in another "
                          f"--ckpt.output_dir (or delete this one).")
    saved = run_dir / "config.yaml"
    if checkpoint is not None and saved.is_file():
        try:
            previous = config_from_dict(yaml.safe_load(saved.read_text()) or {})
        except (ValueError, yaml.YAMLError) as err:
            raise RunDirError(f"--ckpt.load_enable: cannot read {saved} to check this resume against it "
                              f"({err})") from None
        conflicts = resume_conflicts(previous, config)
        if conflicts:
            raise RunDirError(
                f"--ckpt.load_enable: this configuration differs from the run's {saved} in "
                f"{len(conflicts)} key(s) a resume may not change: {'; '.join(conflicts)}. Resume with the run's "
                f"own settings (e.g. --config {saved}), or start a new run in another --ckpt.output_dir. A resume "
                f"may change only {', '.join(MAY_CHANGE_ON_RESUME_HELP)}.")


def _lock_run_dir(run_dir: Path) -> DirectoryLock:
    """Hold an exclusive lock on the run directory for this process's lifetime: two runs writing into the
    same directory would interleave their metrics and checkpoints. ``flock``, or an owner file where the
    filesystem has none (Lustre, NFS without lockd: ``dirlock``)."""
    try:
        return claim_directory(run_dir, "--ckpt.output_dir", "run")
    except DirectoryBusy as busy:
        raise SystemExit(f"error: {busy}") from None


def _write_config(config: Config, run_dir: Path) -> None:
    """Write the resolved ``config.yaml``. On a resume that changed keys a resume may change (check_run_dir
    refused the others), the previous file is kept beside it as ``config.<unix time>.yaml`` and the change logged."""
    path = run_dir / "config.yaml"
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if path.exists():
        if path.read_text() == text:
            return
        previous = config_from_dict(yaml.safe_load(path.read_text()) or {})
        changed = [key for key in config_differences(previous, config) if key != "ckpt.load_enable"]
        if not changed:  # the resume flag itself is not a setting of the run
            path.write_text(text)
            return
        kept = run_dir / f"config.{int(time.time())}.yaml"
        shutil.copy(path, kept)
        log.warning("resuming with changed settings (%s); the previous config.yaml is kept as %s",
                    ", ".join(changed) or "formatting only", kept.name)
    replace_text(path, text)


def claim_run_dir(config: Config):
    """Make the run directory this process's: refuse an existing run unless resuming (:func:`check_run_dir`),
    lock it, write the resolved ``config.yaml``. Every entry point calls this before :func:`run`; keep the
    returned lock for the run's lifetime (``close()`` releases it)."""
    check_run_dir(config)
    run_dir = Path(config.ckpt.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = _lock_run_dir(run_dir)
    _write_config(config, run_dir)
    return handle


def _make_tracker(config: Config, run_dir: Path, meta: Mapping[str, Any] | None = None) -> Tracker:
    wandb = None
    w = config.logger.wandb
    if w.project or w.key:
        wandb = {"project": w.project or "openrlhf_populora", "entity": w.org, "group": w.group,
                 "name": w.run_name or run_dir.name, "mode": w.mode, "key": w.key,
                 "config": config.to_dict()}
    meta = dict(meta) if meta is not None else {"mode": config.populora.mode, "label": run_dir.name}
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


class _DeferredStop:
    """SIGTERM and SIGINT during a run: the first is noted (``requested``) and acted on between steps; a second
    raises ``KeyboardInterrupt`` at once. Installed in the main thread only (Python delivers signals there); a
    SIGINT the process was started ignoring (``nohup``, ``&``) stays ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s: finishing the step in progress, then checkpointing it and stopping (send it again to stop "
                    "at once, back at the last checkpoint)", self.name)

    def __enter__(self) -> _DeferredStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


STEP_PHASES = ("match", "propose", "check", "solve", "verify", "train", "evolve", "probe")  # SelfPlay.run_step's, in order


@dataclass
class RunHooks:
    """How a use of the runner departs from a plain run: the retention study retrains its children this way
    (``studies/retention.py``). Every default is what a plain run does."""

    # a new run's first state, instead of fresh adapters and seeded buffers; the runner checkpoints it
    start: Callable[[SelfPlay], None] | None = None
    # called once the loop holds its first state, started or resumed, before the first step: for what a checkpoint
    # does not keep (``SelfPlay.frozen``)
    ready: Callable[[SelfPlay], None] | None = None
    # called after each completed step, before its record is logged; what it returns joins that record
    on_step: Callable[[SelfPlay, StepOutput], Mapping[str, Any] | None] | None = None
    # the step to stop after (default ``populora.total_steps``, which also spans the learning-rate schedule)
    last_step: int | None = None
    # ``run_meta.json``'s label and mode (default: the run directory's name and ``populora.mode``)
    meta: Mapping[str, Any] | None = None


def default_sandbox(config: Config):
    """The sandbox a run's programs execute in, as ``populora.sandbox`` sets it (entered as a context manager)."""
    from openrlhf_populora.sandbox import Sandbox

    sb = config.populora.sandbox
    return Sandbox(workers=sb.workers, timeout_s=sb.timeout_s, memory_mb=sb.memory_mb, isolation=sb.isolation)


def run(config: Config, build_engine: Callable[[Config], Any], sandbox_factory: Callable[[], Any] | None = None,
        progress: bool = True, hooks: RunHooks | None = None) -> int:
    """Run (or resume) the configured self-play run. Returns a process exit status: 0 when every step ran, 130 when
    a signal stopped it (after checkpointing the last whole step). An exception in any phase raises ``RunFailed``
    (from it) after leaving the run at its last checkpoint. The engine is built here and closed at the end."""
    engine = build_engine(config)
    try:
        return run_on(engine, config, sandbox_factory, progress, hooks)
    finally:
        engine.close()


def run_on(engine: Any, config: Config, sandbox_factory: Callable[[], Any] | None = None, progress: bool = True,
           hooks: RunHooks | None = None) -> int:
    """:func:`run` on an engine the caller built and closes (a study retraining several children on one engine)."""
    sandbox_factory = sandbox_factory or (lambda: default_sandbox(config))
    state = _Run(config, hooks or RunHooks(), progress)
    with _DeferredStop() as stop:
        try:
            with sandbox_factory() as sandbox:
                state.play(engine, sandbox, stop)
        except Exception as err:  # noqa: BLE001 - the sandbox or the loop failed to start or to close
            state.failure = state.failure or err
        finally:
            state.tracker.close()
    return state.outcome(stop)


class _Run:
    """One run in progress: its loop and tracker, where it is (for the report of a failure) and the step of its
    newest checkpoint."""

    def __init__(self, config: Config, hooks: RunHooks, progress: bool) -> None:
        self.config, self.hooks, self.progress = config, hooks, progress
        self.run_dir = Path(config.ckpt.output_dir)
        self.total = config.populora.total_steps if hooks.last_step is None else hooks.last_step
        self.tracker = _make_tracker(config, self.run_dir, hooks.meta)
        self.saved: int | None = None  # the step of the newest checkpoint on disk
        self.phase, self.step = "start", 0  # where the run is (for the report of a failure)
        self.failure: Exception | None = None
        self.aborted = False
        self.loop: SelfPlay | None = None
        self.bar = None

    def checkpoint_now(self) -> None:
        if self.saved != self.loop.step:
            ckpt = self.config.ckpt
            save_checkpoint(self.config.checkpoint_dir, self.loop.step, self.loop.save_state, max_num=ckpt.max_num,
                            keep_every=ckpt.keep_every)
            self.saved = self.loop.step

    def on_phase(self, name: str) -> None:
        self.phase = name
        self.bar.set_description(f"self-play [{name}]")

    def play(self, engine: Any, sandbox: Any, stop: _DeferredStop) -> None:
        """Start or resume, run the steps, checkpoint and export; a failure or a second signal is kept for
        :meth:`outcome`."""
        self.loop = SelfPlay(self.config, engine, sandbox, self.run_dir, self.tracker)
        try:
            self._begin()
            self._steps(stop)
            self.phase, self.step = "the final checkpoint", self.loop.step
            self.checkpoint_now()
            self.phase = "exporting the adapters"
            _export(self.loop, self.run_dir)
        except KeyboardInterrupt:  # a second signal: stop now, leaving the last checkpoint as it is
            self.aborted = True
        except Exception as err:  # noqa: BLE001 - reported in one line by outcome(), the traceback in error.log
            self.failure = err
        finally:
            if self.bar is not None:
                self.bar.close()

    def _begin(self) -> None:
        loop, ckpt = self.loop, self.config.ckpt
        checkpoint = latest_checkpoint(self.config.checkpoint_dir) if ckpt.load_enable else None
        if checkpoint is not None:
            self._resume(checkpoint)
        else:
            if ckpt.load_enable:  # check_run_dir refused a run with steps but no checkpoint
                log.info("--ckpt.load_enable: nothing to resume in %s, starting a new run", self.run_dir)
            self._start()
        if self.hooks.ready is not None:
            self.hooks.ready(loop)
        if checkpoint is None or loop.step < self.total:  # a resume with no step to train leaves no record
            self.tracker.add_session(provenance(from_step=loop.step, resumed=checkpoint is not None))
        else:
            log.info("the run is already at step %d of %d: nothing to train", loop.step, self.total)
        self.bar = tqdm(total=self.total, initial=loop.step, disable=not self.progress, desc="self-play",
                        unit="step", dynamic_ncols=True)
        loop.on_phase = self.on_phase

    def _resume(self, checkpoint: Path) -> None:
        loop = self.loop
        self.phase = f"resuming from {checkpoint}"
        loop.load_state(checkpoint)
        # the run was extended past a last step that was due to evolve: it evolves now, and the events of an
        # earlier try that stopped before the next checkpoint are dropped (the checkpoint has no child)
        catch_up = loop.evolution_pending and loop.step < self.total
        self.tracker.truncate_after(loop.step, forget_events="evolution" if catch_up else None)
        self.saved = loop.step
        log.info("resumed from %s at step %d", checkpoint, loop.step)
        if catch_up:
            self.phase = f"the evolution of step {loop.step}, which was the run's last"
            for event in loop.evolve_pending():
                self.tracker.log_event(loop.step, {"kind": "evolution", **event})

    def _start(self) -> None:
        loop = self.loop
        if self.hooks.start is not None:
            self.phase = "starting"
            self.hooks.start(loop)
            self.phase = "checkpointing the first state"
        else:
            self.phase = "seeding"
            loop.create_adapters()
            tic = time.perf_counter()
            sizes = loop.seed_buffers()
            self.tracker.log_event(0, {"kind": "seeding", "buffer_sizes": sizes,
                                       "seconds": time.perf_counter() - tic})
            self.phase = "checkpointing the seeded state"
        self.checkpoint_now()  # what a failure before the first periodic checkpoint goes back to

    def _steps(self, stop: _DeferredStop) -> None:
        loop, tracker, ckpt = self.loop, self.tracker, self.config.ckpt
        while loop.step < self.total and not stop.requested:
            self.step, self.phase = loop.step + 1, "match"
            output = loop.run_step()
            self.phase = "logging"
            metrics = step_metrics(loop, output)
            if self.hooks.on_step is not None:
                metrics.update(self.hooks.on_step(loop, output) or {})
            tracker.log(output.step, metrics)
            tracker.log_problems(output.step, problem_records(output))
            for event in output.evolution:
                tracker.log_event(output.step, {"kind": "evolution", **event})
            self.bar.update(1)
            self.bar.set_postfix(progress_postfix(metrics))
            if output.step % self.config.logger.logging_steps == 0:
                log.info("step %d: %s", output.step, _one_line(metrics))
            if ckpt.save_steps > 0 and loop.step % ckpt.save_steps == 0:
                self.phase = "checkpointing"
                self.checkpoint_now()

    def outcome(self, stop: _DeferredStop) -> int:
        """The run's exit status (:func:`run`); ``RunFailed`` after a failure, its traceback in ``error.log``."""
        run_dir, saved, phase, loop = self.run_dir, self.saved, self.phase, self.loop
        resume = (f"resume with --ckpt.load_enable --ckpt.output_dir {run_dir}" if saved is not None else
                  "the same command starts it afresh")
        at = f"the run stays at step {saved} (its last checkpoint)" if saved is not None else "no step was saved"
        if self.failure is not None:
            failure = self.failure
            where = f"step {self.step} failed in {phase}" if phase in (*STEP_PHASES, "logging") else \
                f"the run failed in {phase}"
            first_line = (str(failure).strip().splitlines() or [""])[0]
            message = f"{where}: {type(failure).__name__}: {first_line}; {at}; {resume}"
            try:
                with open(run_dir / "error.log", "a", encoding="utf-8") as handle:
                    handle.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
                    handle.write("".join(traceback.format_exception(failure)) + "\n")
                message += f" (traceback in {run_dir / 'error.log'})"
            except OSError:
                pass
            log.error(message)
            raise RunFailed(message) from failure
        if self.aborted:
            log.warning("stopped at once (in %s): %s; %s", phase, at, resume)
            return 130
        if loop is not None and loop.step < self.total:
            log.warning("%s: stopped after step %d, checkpointed; resume with --ckpt.load_enable --ckpt.output_dir %s",
                        stop.name, loop.step, run_dir)
            return 130
        if self.config.populora.report:
            from openrlhf_populora.analysis.report import render_report

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
