"""The pinned OpenRLHF 0.11.2 patches: version gate, apply/revert, and the source-hash lock."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
from openrlhf_populora.patches import openrlhf_0_11_2 as patches
from openrlhf_populora.patches.openrlhf_0_11_2 import lock

pytest.importorskip("openrlhf")

TARGET_A = "openrlhf.trainer.ppo_trainer:PPOTrainer"
TARGET_B = "openrlhf.trainer.ray.vllm_engine:RolloutRayActor"


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    assert patches.applied() == []
    yield
    patches.revert()


@pytest.fixture(scope="module")
def computed_lock():
    return lock.compute()


@pytest.mark.parametrize("found", ["0.11.3", None])
def test_apply_refuses_any_other_openrlhf_version(monkeypatch, found):
    monkeypatch.setattr(patches, "installed_version", lambda: found)
    original = patches.lookup(TARGET_A)
    with pytest.raises(patches.UpstreamVersionError) as err:
        patches.apply([patches.Patch(TARGET_A, object(), "test")])
    message = str(err.value)
    assert "openrlhf==0.11.2" in message and "pip install --no-deps openrlhf==0.11.2" in message
    assert ("no openrlhf" if found is None else "openrlhf==0.11.3") in message
    assert patches.lookup(TARGET_A) is original and patches.applied() == []


def test_apply_is_idempotent_and_revert_restores_the_originals():
    originals = {t: patches.lookup(t) for t in (TARGET_A, TARGET_B)}
    first, second = object(), object()
    swaps = [patches.Patch(TARGET_A, first, "a"), patches.Patch(TARGET_B, second, "b")]
    patches.apply(swaps)
    patches.apply(swaps)  # twice: still one record per target, the original kept
    assert patches.lookup(TARGET_A) is first and patches.lookup(TARGET_B) is second
    assert patches.applied() == [TARGET_A, TARGET_B]
    patches.apply([patches.Patch(TARGET_A, second, "again")])  # re-applying over a swap keeps the true original
    patches.revert()
    assert {t: patches.lookup(t) for t in originals} == originals
    assert patches.applied() == []
    patches.revert()  # nothing left: a no-op
    assert {t: patches.lookup(t) for t in originals} == originals


def test_every_hash_in_the_lock_matches_the_installed_upstream(computed_lock):
    stored = patches.load_lock()
    assert stored, f"{patches.LOCK_FILE} is missing: run python -m {lock.__name__} --write"
    assert lock.differences(stored, computed_lock) == []
    assert stored["openrlhf_version"] == patches.UPSTREAM_VERSION
    assert len(stored["flags"]) == 167
    # the sha256 of train_ppo_ray.py as installed from the openrlhf 0.11.2 wheel, recorded when its seams were read
    train_file = stored["files"]["openrlhf/cli/train_ppo_ray.py"]
    assert train_file.startswith("a57da6a9") and train_file.endswith("096ab")


def test_the_lock_covers_every_relied_on_function_and_every_patch_target():
    sources = patches.load_lock()["sources"]
    for target in [*lock.RELIED_ON, *lock.patch_targets()]:
        assert target in sources, f"{target} is not in the lock"


def test_cpu_patch_targets_are_locked_when_the_cpu_patches_exist():
    cpu = pytest.importorskip("openrlhf_populora.patches.openrlhf_0_11_2.cpu")
    sources = patches.load_lock()["sources"]
    for patch in cpu.cpu_patches():
        assert patch.target in sources, f"cpu patch target {patch.target} is not in the lock"


def test_a_changed_upstream_function_is_reported(computed_lock):
    tampered = copy.deepcopy(computed_lock)
    tampered["sources"]["openrlhf.cli.train_ppo_ray:train"] = "0" * 64
    del tampered["flags"]["--vllm.num_engines"]
    tampered["openrlhf_version"] = "0.11.1"
    lines = lock.differences(tampered, computed_lock)
    assert any("openrlhf.cli.train_ppo_ray:train changed" in line for line in lines)
    assert any("--vllm.num_engines is not in the lock" in line for line in lines)
    assert any("openrlhf version" in line for line in lines)


def test_hashes_read_the_originals_while_patches_are_applied(computed_lock):
    class StandIn:  # a different class at a swapped target, and under a method of a Ray actor class
        def __init__(self):
            pass

    patches.apply([patches.Patch(TARGET_B, StandIn, "test")])
    targets = [TARGET_B, f"{TARGET_B}.__init__"]
    assert lock.source_hashes(targets) == {t: computed_lock["sources"][t] for t in targets}


def test_ray_actor_methods_hash_the_wrapped_class_method():
    actor_class = patches.lookup(TARGET_B)
    wrapped = actor_class.__ray_actor_class__.generate
    assert lock.source_hashes([f"{TARGET_B}.generate"])[f"{TARGET_B}.generate"] == patches.source_hash(wrapped)


def test_check_command_passes_and_write_round_trips(tmp_path, computed_lock, capsys):
    assert lock.main(["--check"]) == 0
    assert "matches openrlhf==0.11.2" in capsys.readouterr().out
    path = tmp_path / "lock.json"
    lock.write(computed_lock, path)
    import json

    assert json.loads(path.read_text()) == json.loads(json.dumps(computed_lock))
    assert path.read_text() == patches.LOCK_FILE.read_text()  # the stored file is exactly what --write writes


def test_flag_snapshot_is_json_safe_and_stable():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--a.inf", type=float, default=float("inf"))
    parser.add_argument("--a.pair", type=float, nargs=2, default=(0, 1))
    parser.add_argument("--a.on", action="store_true", default=True)
    parser.add_argument("--a.off", dest="a.on", action="store_false")
    parser.add_argument("--logger.wandb.run_name", default="ppo_1202T20:59")
    assert lock.flag_snapshot(parser) == {
        "--a.inf": {"dest": "a.inf", "default": "inf"},
        "--a.off": {"dest": "a.on", "default": True},
        "--a.on": {"dest": "a.on", "default": True},
        "--a.pair": {"dest": "a.pair", "default": [0, 1]},
        "--logger.wandb.run_name": {"dest": "logger.wandb.run_name",
                                    "default": lock.VOLATILE_DEFAULTS["logger.wandb.run_name"]},
    }


def test_placeholders_stand_in_only_for_missing_packages_and_leave_no_trace():
    name = "populora_test_missing_pkg"
    with lock.placeholders_for_missing(("json", name)) as replaced:
        assert replaced == [name]
        module = importlib.import_module(f"{name}.inputs")
        assert isinstance(module.TokensPrompt, type)
        from populora_test_missing_pkg import SamplingParams  # noqa: F401 - any attribute imports
    assert name not in sys.modules and f"{name}.inputs" not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module(name)
