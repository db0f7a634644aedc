"""The GPU install, checked without a GPU: ``scripts/install-gpu.sh`` run with stand-ins for the Python it installs
into (it records each call and succeeds; pip itself never runs) and for nvcc and nvidia-smi, and the offline parts
of ``scripts/gpu_resolve.py`` (CI runs the resolve itself against PyPI: ``.ci/run``, ``make check-gpu-deps``).
"""

from __future__ import annotations

import os
import platform
import runpy
import subprocess
from pathlib import Path

import pytest
from paths import ROOT

SCRIPT = ROOT / "scripts" / "install-gpu.sh"

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                                reason="the GPU install is for Linux x86_64")

# the stand-in Python: one line per call, "<build switches>\t<arguments>", plus the constraint file's lines
STUB_PYTHON = r"""#!/usr/bin/env bash
printf 'DS_BUILD_FUSED_ADAM=%s MAX_JOBS=%s\t%s\n' "${DS_BUILD_FUSED_ADAM:-}" "${MAX_JOBS:-}" "$*" >> "$LOG"
prev=
for arg in "$@"; do
    [[ $prev == -c && -f $arg ]] && sed 's/^/constraint: /' "$arg" >> "$LOG"
    prev=$arg
done
exit 0
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def run_install(tmp_path: Path, nvcc_release: str | None, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script with the stand-in Python, nvcc of ``nvcc_release`` under ``$CUDA_HOME`` (None: no CUDA at
    all) and an nvidia-smi reporting driver 580. Returns the run and the stand-in's log lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    python = _executable(bin_dir / "python-stub", STUB_PYTHON)
    _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 580.65.06\n")
    system_path = ":".join(p for p in ("/usr/bin", "/bin") if Path(p).is_dir())
    environment = {"PATH": f"{bin_dir}:{system_path}", "HOME": str(tmp_path), "PYTHON": str(python), "LOG": str(log)}
    if nvcc_release is not None:
        cuda = tmp_path / "cuda"
        (cuda / "bin").mkdir(parents=True, exist_ok=True)
        _executable(cuda / "bin" / "nvcc", f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_release}, "
                                          f"V{nvcc_release}.48'\n")
        environment["CUDA_HOME"] = str(cuda)
    environment.update(env)
    done = subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


def _index(lines: list[str], *parts: str) -> int:
    hits = [i for i, line in enumerate(lines) if all(p in line for p in parts)]
    assert len(hits) == 1, (parts, lines)
    return hits[0]


def test_the_install_builds_against_torch_in_order_without_isolation(tmp_path):
    """torch first; flash-attn and DeepSpeed built after it without build isolation (flash-attn's setup imports
    torch), DeepSpeed with FusedAdam prebuilt and reinstalled; then the [gpu] extra with all three held by
    constraints; pip check last. Catches a build under isolation, a missing DS_BUILD_FUSED_ADAM, and the extra
    installed before the builds (pip would then build flash-attn itself, isolated)."""
    done, calls = run_install(tmp_path, "13.0")
    assert done.returncode == 0, done.stderr
    torch = _index(calls, "-m pip install", "torch==2.13.0")
    flash = _index(calls, "-m pip install", "flash-attn==2.8.3")
    deepspeed = _index(calls, "-m pip install", "deepspeed==0.19.6")
    extra = _index(calls, "-m pip install", "-e .[gpu]")
    assert torch < flash < deepspeed < extra
    assert "--no-build-isolation" in calls[flash] and "MAX_JOBS=4" in calls[flash]
    assert "--no-build-isolation" in calls[deepspeed] and "--force-reinstall" in calls[deepspeed]
    assert calls[deepspeed].startswith("DS_BUILD_FUSED_ADAM=1 ")
    assert [line for line in calls if line.startswith("constraint: ")] == [
        "constraint: torch==2.13.0", "constraint: flash-attn==2.8.3", "constraint: deepspeed==0.19.6"]
    assert _index(calls, "-m pip check") > extra
    assert "installing into" in done.stdout


def test_a_given_flash_attn_wheel_is_installed_instead_of_built(tmp_path):
    done, calls = run_install(tmp_path, "13.0", FLASH_ATTN_WHEEL="/wheels/flash_attn-2.8.3-cp311-linux_x86_64.whl")
    assert done.returncode == 0, done.stderr
    assert "/wheels/flash_attn-2.8.3" in calls[_index(calls, "-m pip install", "flash_attn-2.8.3-cp311")]
    assert not [line for line in calls if "flash-attn==2.8.3" in line and "--no-build-isolation" in line]


def test_a_cuda_home_without_nvcc_stops_before_any_download_saying_what_to_do(tmp_path):
    """Catches the builds started without nvcc (DeepSpeed's FusedAdam would then JIT on every rank at start)."""
    (tmp_path / "no-cuda").mkdir()
    done, calls = run_install(tmp_path, None, CUDA_HOME=str(tmp_path / "no-cuda"))
    assert done.returncode == 1
    assert "CUDA_HOME" in done.stderr and "nvcc" in done.stderr and "module load cuda/13.0" in done.stderr
    assert not [line for line in calls if "pip install" in line]


def test_no_cuda_toolkit_anywhere_stops_too(tmp_path):
    if Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("this machine has a CUDA toolkit at /usr/local/cuda, where the script looks last")
    done, calls = run_install(tmp_path, None)
    assert done.returncode == 1 and "no CUDA toolkit found" in done.stderr
    assert not [line for line in calls if "pip install" in line]


def test_a_cuda_toolkit_of_another_major_version_is_refused(tmp_path):
    done, calls = run_install(tmp_path, "12.4")
    assert done.returncode == 1
    assert "CUDA 12.4" in done.stderr and "CUDA 13" in done.stderr
    assert not [line for line in calls if "pip install" in line]


# ------------------------------------------------------------------------------ scripts/gpu_resolve.py


@pytest.fixture(scope="module")
def resolve():
    return runpy.run_path(str(ROOT / "scripts" / "gpu_resolve.py"), run_name="gpu_resolve")


def test_the_resolve_reads_the_pins_of_the_gpu_extra(resolve):
    pins = resolve["gpu_pins"]()
    assert pins == {"torch": "2.13.0", "vllm": "0.29.0", "flash-attn": "2.8.3"}


def test_the_resolve_ignores_local_pip_settings_that_stand_in_for_pypi(resolve, monkeypatch):
    """A local wheel directory (this machine's PIP_FIND_LINKS holds a CPU torch 2.13.0) or constraint file would
    satisfy the pins with other builds; the index, certificate and timeout settings are kept."""
    for key, value in {"PIP_FIND_LINKS": "/opt/wheels", "PIP_CONSTRAINT": "/etc/c.txt", "PIP_NO_INDEX": "1",
                       "PIP_INDEX_URL": "https://mirror.example/simple", "PIP_CERT": "/etc/ca.pem"}.items():
        monkeypatch.setenv(key, value)
    env = resolve["pip_env"]()
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert not {"PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX"} & set(env)
    assert env["PIP_INDEX_URL"] == "https://mirror.example/simple" and env["PIP_CERT"] == "/etc/ca.pem"


def test_flash_attn_is_recorded_as_installed_with_its_declared_requirements(resolve, tmp_path):
    """What stands in for the flash-attn build: its sdist's PKG-INFO as an installed distribution's metadata,
    which Python's own importlib.metadata (as pip) then reads as installed flash-attn 2.8.3 needing torch, einops."""
    from importlib.metadata import distributions

    metadata = "Metadata-Version: 2.2\nName: flash_attn\nVersion: 2.8.3\nRequires-Dist: torch\nRequires-Dist: einops\n"
    assert resolve["requires_dist"](metadata) == ["torch", "einops"]
    resolve["fake_installed"](tmp_path, "flash-attn", "2.8.3", metadata)
    (found,) = list(distributions(path=[str(tmp_path)]))
    assert (found.metadata["Name"], found.version, found.requires) == ("flash_attn", "2.8.3", ["torch", "einops"])


def test_install_gpu_pins_equal_pyproject(resolve):
    """The script installs torch, flash-attn and DeepSpeed before the extra: its pins must be the extra's (and
    DeepSpeed's, in openrlhf-cpu), or the extra's install would replace what was just built."""
    import re

    script = dict(re.findall(r'^[A-Z_]+="([a-z-]+)==([0-9.]+)"', SCRIPT.read_text(), re.M))
    pins = resolve["gpu_pins"]()
    extras = resolve["tomllib"].loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (deepspeed,) = [r.split("==")[1] for r in extras["openrlhf-cpu"] if r.startswith("deepspeed==")]
    assert script == {"torch": pins["torch"], "flash-attn": pins["flash-attn"], "deepspeed": deepspeed}
