"""Resolve the GPU install's requirements against PyPI without installing anything (CI: no GPU, no CUDA).

What ``scripts/install-gpu.sh`` installs on a cluster, the project's ``[gpu]`` extra (torch, vLLM, OpenRLHF,
flash-attn, DeepSpeed and the rest), goes through pip's resolver here with ``pip install --dry-run --report``, in
a throwaway virtual environment, so a version conflict fails in CI rather than on the cluster. It prints the
pinned packages as resolved and exits 1 when pip cannot resolve them.

- **flash-attn is source-only**, and pip must build a source distribution's metadata before it can resolve it:
  flash-attn's ``setup.py`` imports torch, so even ``pip install --dry-run --no-deps flash-attn==2.8.3`` fails
  ("Getting requirements to build wheel did not run successfully"). The script downloads the pinned sdist
  (8.4 MB, its sha256 checked against the index), reads the requirements it declares from its ``PKG-INFO``
  (``Requires-Dist``: torch, einops; the same list as its ``setup.py``'s ``install_requires``) and puts that
  metadata in the throwaway environment as an installed ``flash-attn``: pip takes the pin as satisfied, without a
  build, and resolves its requirements with everything else.
- **Small downloads.** pip reads a wheel's metadata without the wheel where the index serves it separately (PEP
  658); otherwise ``--use-feature=fast-deps`` reads it with HTTP range requests. Without either, the dry-run
  downloads every wheel (torch 527 MB, vLLM 316 MB: 4.9 GB measured on an index that did not advertise the
  metadata). pip is pinned in the throwaway environment (:data:`PIP`).
- **PyPI's builds only.** The dry-run reads no pip configuration file and drops ``PIP_*`` variables other than
  the index, certificate, proxy and timeout ones (:data:`KEPT_PIP_ENV`): a local wheel directory or constraint
  file (a CPU torch, say) would otherwise stand in for the cluster's packages.

It resolves for the interpreter that runs it (Linux x86_64, as on the cluster). Usage:
``python3 scripts/gpu_resolve.py [--report FILE] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import venv
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip vendors
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PIP = "pip==26.3"  # has --use-feature=fast-deps and reads PEP 658/714 metadata
INDEX = "https://pypi.org/simple"
KEPT_PIP_ENV = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST",
                "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"}
SHOWN = ("torch", "flash-attn", "deepspeed", "vllm", "openrlhf", "ray", "transformers", "peft", "xgrammar")


def gpu_pins() -> dict[str, str]:
    """``{name: version}`` of the ``==`` pins in pyproject.toml's ``gpu`` extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for requirement in extras["gpu"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", requirement.strip())
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEPT_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then loads no configuration file
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def fetch(url: str, accept: str | None = None) -> tuple[bytes, str]:
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=120, context=context) as response:
        return response.read(), response.headers.get("Content-Type", "")


def sdist_metadata(name: str, version: str) -> tuple[str, int]:
    """The ``PKG-INFO`` of ``name``'s source distribution of ``version`` on the index, and its size in bytes."""
    index = os.environ.get("PIP_INDEX_URL", INDEX).rstrip("/")
    body, kind = fetch(f"{index}/{normalize(name)}/", "application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    wanted = f"{name.replace('-', '_')}-{version}.tar.gz"
    if "json" in kind:
        files = [(f["url"], f["hashes"].get("sha256")) for f in json.loads(body)["files"] if f["filename"] == wanted]
    else:  # PEP 503 HTML: <a href="URL#sha256=HEX">FILENAME</a>
        files = [(url, digest) for url, digest, filename in
                 re.findall(r'href="([^"#]+)#sha256=([0-9a-f]+)"[^>]*>([^<]+)</a>', body.decode())
                 if filename == wanted]
    if not files:
        raise SystemExit(f"gpu_resolve: {wanted} is not on {index}")
    url, digest = files[0]
    if url.startswith("/") or not url.startswith("http"):
        url = urllib.request.urljoin(f"{index}/{normalize(name)}/", url)
    data, _ = fetch(url)
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"gpu_resolve: {wanted}: sha256 does not match the index's")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.extractfile(f"{wanted[:-len('.tar.gz')]}/PKG-INFO")
        return member.read().decode(), len(data)


def requires_dist(metadata: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]


def fake_installed(site_packages: Path, name: str, version: str, metadata: str) -> None:
    """Record ``name`` ``version`` as installed in ``site_packages`` with the given core metadata (no files)."""
    info = site_packages / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(metadata)
    (info / "INSTALLER").write_text("gpu_resolve\n")
    (info / "RECORD").write_text("")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write pip's installation report (JSON) here")
    parser.add_argument("--keep", help="build the throwaway environment here and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    tic = time.monotonic()
    pins = gpu_pins()
    flash_version = pins.get("flash-attn")
    if not flash_version:
        raise SystemExit("gpu_resolve: pyproject.toml's gpu extra pins no flash-attn==VERSION")
    work = Path(args.keep or tempfile.mkdtemp(prefix="populora-gpu-resolve-"))
    try:
        metadata, size = sdist_metadata("flash-attn", flash_version)
        declared = requires_dist(metadata)
        print(f"[gpu-resolve] flash-attn {flash_version}: sdist only ({size / 1e6:.1f} MB read); declares "
              f"{', '.join(declared) or 'nothing'}")
        env_dir = work / "venv"
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        python = env_dir / "bin" / "python"
        env = pip_env()
        subprocess.run([python, "-m", "pip", "install", "-q", PIP], check=True, env=env)
        site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                            text=True).strip())
        fake_installed(site, "flash-attn", flash_version, metadata)
        report = work / "report.json"
        # --only-binary flash-attn: the installed record is its only candidate (a backtracking resolver would
        # otherwise try the sdist, whose metadata cannot be built here)
        done = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--use-feature=fast-deps",
                               "--no-cache-dir", "--only-binary", "flash-attn", "--report", str(report),
                               f"{ROOT}[gpu]"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            print(done.stdout[-6000:], file=sys.stderr)  # pip's reason ("The conflict is caused by: ...") is last
            print(f"[gpu-resolve] FAILED: pip cannot resolve {ROOT.name}[gpu] (exit {done.returncode}) "
                  f"after {time.monotonic() - tic:.0f} s", file=sys.stderr)
            return 1
        resolved = {normalize(item["metadata"]["name"]): item["metadata"] for item in json.loads(report.read_text())["install"]}
        for name in declared:
            dependency = normalize(re.split(r"[\s;<>=!~\[]", name, maxsplit=1)[0])
            if dependency not in resolved:
                print(f"[gpu-resolve] FAILED: flash-attn's requirement {name} was not resolved", file=sys.stderr)
                return 1
        torch = resolved.get("torch", {})
        cuda = [r for r in torch.get("requires_dist", []) if r.startswith(("cuda-toolkit", "nvidia-cudnn"))]
        shown = ", ".join(f"{n} {resolved[n]['version'] if n in resolved else pins.get(n, '?') + ' (held)'}"
                          for n in SHOWN if n in resolved or n in pins)
        print(f"[gpu-resolve] resolved {len(resolved)} packages in {time.monotonic() - tic:.0f} s: {shown}")
        print(f"[gpu-resolve] torch's CUDA: {'; '.join(cuda) or 'none (not a CUDA build)'}")
        if args.report:
            shutil.copyfile(report, args.report)
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
