"""Where each committed run came from: its starts and resumes (``sessions`` in run_meta.json), as markdown.

usage: python results/provenance.py RUN_DIR [RUN_DIR ...]
  e.g. python results/provenance.py results/cpu-signature-v2/*-s*

The committed record of step s was written by the last session whose ``from_step`` is below s (a resume goes
back to its checkpoint and rewrites every later step). Each step's ``time`` in metrics.jsonl is checked against
that reading: a step logged before its session started, or after the next session started, is listed as a
mismatch. "Longest pause": the most time between two logged steps not spent in the later step itself
(``time/step``), a sign of a stop and resume even where no session was recorded. Only the standard library, so
it runs from a bare clone.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ENVIRONMENT = ("cpu", "cpu_flags", "torch_cpu_capability", "torch_threads", "platform", "python", "packages", "cuda")


def ranges(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'; [] -> 'none'."""
    out: list[str] = []
    for s in sorted(steps):
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out) or "none"


def utc(seconds: float | None) -> str:
    return "?" if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M")


def load(run: Path) -> tuple[list[dict], dict[int, float], str]:
    """The run's sessions, {step: time logged} from metrics.jsonl, and its longest pause between steps."""
    sessions = json.loads((run / "run_meta.json").read_text()).get("sessions", [])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = {int(r["step"]): r.get("time") for r in records}
    pauses = [(b["time"] - a["time"] - b["time/step"], b["step"]) for a, b in zip(records, records[1:], strict=False)
              if None not in (a.get("time"), b.get("time"), b.get("time/step"))]
    longest = max(pauses, default=None)
    return sessions, times, "?" if longest is None else f"{longest[0] / 60:.1f} min, before step {longest[1]}"


def owners(sessions: list[dict], steps: list[int]) -> dict[int, int | None]:
    """step -> index of the session that wrote its committed record (None: no session before it)."""
    return {s: max((i for i, x in enumerate(sessions) if x["from_step"] < s), default=None) for s in steps}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    environments: list[dict] = []  # distinct machine + software records, numbered E1, E2, ... in order seen
    summary, detail, problems, skipped = [], [], [], []
    for run in map(Path, argv):
        if not (run / "run_meta.json").is_file() or not (run / "metrics.jsonl").is_file():
            skipped.append(str(run))  # e.g. stock OpenRLHF's TensorBoard files: no run_meta.json
            continue
        sessions, times, pause = load(run)
        steps = sorted(times)
        if not sessions:
            summary.append(f"| {run.name} | {len(steps)} | not recorded (run_meta.json has no sessions) | ? | ? | ? "
                           f"| {pause} |")
            continue
        owner = owners(sessions, steps)
        envs, dirty = [], []
        for i, x in enumerate(sessions):
            env = {k: x.get(k) for k in ENVIRONMENT}
            if env not in environments:
                environments.append(env)
            envs.append(f"E{environments.index(env) + 1}")
            wrote = [s for s in steps if owner[s] == i]
            if x.get("dirty"):
                dirty += wrote
            start = "start" if not x.get("resumed") else "resume"
            commit = (x.get("commit") or "no git checkout")[:7]
            state = {True: "yes", False: "no"}.get(x.get("dirty"), "unknown")
            detail.append(f"| {run.name} | {i + 1} | {start} | {x['from_step']} | {ranges(wrote)} | {commit} | "
                          f"{state} | {utc(x.get('time'))} | {envs[-1]} |")
        for s in steps:  # a step's time must fall inside its session's window
            i, t = owner[s], times[s]
            if i is None:
                problems.append(f"{run.name}: step {s} precedes every session")
            elif t is not None and (t < sessions[i]["time"] or (i + 1 < len(sessions) and t >= sessions[i + 1]["time"])):
                problems.append(f"{run.name}: step {s} logged at {utc(t)}, outside session {i + 1}'s window")
        commits = list(dict.fromkeys((x.get("commit") or "none")[:7] for x in sessions))
        summary.append(f"| {run.name} | {len(steps)} | {len(sessions)} | {len(commits)}: {', '.join(commits)} | "
                       f"{ranges(dirty)} | {', '.join(dict.fromkeys(envs))} | {pause} |")
    print("| run | steps | starts + resumes | commits | steps on a dirty tree | environments | longest pause |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    if detail:
        print("\n| run | session | kind | from step | steps it wrote | commit | dirty tree | started (UTC) | environment |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(detail))
        print("\n| environment | " + " | ".join(ENVIRONMENT) + " |")
        print("|---|" + "---|" * len(ENVIRONMENT))
        for k, env in enumerate(environments, 1):
            cells = [", ".join(f"{a} {b}" for a, b in v.items()) if isinstance(v, dict)
                     else " ".join(v) if isinstance(v, list) else str(v) for v in env.values()]
            print(f"| E{k} | " + " | ".join(cells) + " |")
        print("\nCheck: " + ("every step's logged time lies inside the window of the session said to write it."
                              if not problems else "steps logged outside their session's window:"))
    for p in problems:
        print(f"- {p}")
    if skipped:
        print("\nNot run directories (no run_meta.json or metrics.jsonl), skipped: " + ", ".join(skipped))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
