"""What a run (or each resumed part of it) ran with: the code, the packages, the machine.

A run resumes across sessions and machines, and its numbers depend on all three: a commit that changes a prompt
changes every sample after it, and two CPUs can round the same matmul differently, so a seeded run repeated on
another machine samples other tokens within a few steps. ``run_meta.json`` therefore keeps one record per start
or resume (``sessions``, see ``Tracker.add_session``), and a reader can tell a run made by one commit on one
machine from one stitched together.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "peft", "openrlhf_populora")


_ROOT = Path(__file__).resolve().parents[2]  # the checkout's root, when the package runs from one


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version() -> dict[str, Any]:
    """The project's git commit and whether tracked files differ from it (``dirty``), when it runs from its own
    git checkout (an installed copy inside some other repository is not one); otherwise just its installed
    version (``packages``)."""
    top = _git("rev-parse", "--show-toplevel")
    commit = _git("rev-parse", "HEAD") if top and Path(top).resolve() == _ROOT else None
    if commit is None:
        return {"commit": None}
    changes = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(changes) if changes is not None else None}


# instruction sets that decide which kernels (and so which rounding) torch uses for bf16 and fp32 matmuls
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``ISA_FLAGS`` it has (``/proc/cpuinfo``; a virtual machine often names
    only a family, "Intel(R) Xeon(R) Processor", so the flags say more), or what ``platform`` knows."""
    name, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ISA_FLAGS if f in have]
                break
    except OSError:
        pass
    return name, flags


def provenance(**extra: Any) -> dict[str, Any]:
    """One record of the code, packages and machine this process runs on, with ``extra`` (e.g. the step)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cpu, flags = cpu_model()
    record: dict[str, Any] = {**extra, **code_version(), "python": sys.version.split()[0], "packages": versions,
                              "cpu": cpu, "cpu_flags": flags, "platform": platform.platform()}
    try:
        import torch

        record["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        record["torch_threads"] = torch.get_num_threads()
        record["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return record
