"""benchmarks/gpu_smoke.sh, the GPU check users run on their clusters, must launch: its commands parse with the
real launcher (upstream's parser, the --populora.* group, the refusals) and pass upstream's validation. It died
at launch before: ``--populora.report false`` handed a stray ``false`` to argparse."""

from __future__ import annotations

import os
import subprocess

import pytest

pytest.importorskip("openrlhf")

from openrlhf_populora.patches import openrlhf_0_11_2 as patches  # noqa: E402
from paths import ROOT

from openrlhf_populora.build import ray as launch  # noqa: E402


def test_every_gpu_smoke_launch_parses_and_passes_upstream_validation(monkeypatch, tmp_path):
    import ray

    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_smoke.sh")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True,
                         env={**os.environ, "DRY_RUN": "1", "MODEL": "/models/smollm2", "OUT": str(tmp_path)})
    launches = [block.splitlines() for block in out.stdout.strip().split("\n\n")]
    assert [argv[:2] for argv in launches] == [["-m", "openrlhf_populora.cli.train"]] * 2
    modes = []
    for argv in launches:
        args = launch.parse_launch_args(argv[2:])  # exit 2 on any unknown flag, bad value or refusal
        modes.append(args.populora.mode)
        assert args.populora.report is False and args.populora.total_steps == 4

        class Reached(Exception):
            pass

        def reached():  # train()'s first statement: upstream's validation has passed
            raise Reached

        monkeypatch.setattr(ray, "is_initialized", reached)
        with pytest.raises(Reached):
            launch.run_upstream(args, [])
        assert patches.applied() == []
    assert modes == ["population", "baseline"]
