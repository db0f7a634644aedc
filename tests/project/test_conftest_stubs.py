"""The conftest stubs stand in only for packages that cannot import here, and OpenRLHF imports with them."""

import importlib
import importlib.util
import subprocess
import sys

import pytest


def _really_importable(name: str) -> bool:
    code = f"import {name}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("name", ["flash_attn", "vllm"])
def test_stub_used_only_when_real_package_missing(name, stubbed_packages):
    module = sys.modules[name]
    is_stub = getattr(module, "__populora_stub__", False)
    if _really_importable(name):
        assert not is_stub and name not in stubbed_packages
    else:
        assert is_stub and name in stubbed_packages


def test_real_packages_are_never_stubbed(stubbed_packages):
    for name in ["torch", "transformers", "peft", "trueskill", "ribs", "radon", "deepspeed", "ray", "openrlhf"]:
        module = importlib.import_module(name)
        assert not getattr(module, "__populora_stub__", False), name
        assert name not in stubbed_packages


def test_stub_refuses_to_be_used_as_real(stubbed_packages):
    if "flash_attn" not in stubbed_packages:
        pytest.skip("real flash_attn installed")
    from flash_attn.bert_padding import unpad_input

    with pytest.raises(RuntimeError, match="test stub"):
        unpad_input(None, None)


def test_openrlhf_deep_modules_import():
    """OpenRLHF's loss, models and Ray trainer import on this machine (real deps + stubs for the missing two)."""
    from importlib.metadata import version

    assert version("openrlhf") == "0.11.2"
    importlib.import_module("openrlhf.models.loss")
    importlib.import_module("openrlhf.models.actor")
    importlib.import_module("openrlhf.trainer.ppo_trainer")


def test_project_imports():
    import openrlhf_populora

    assert openrlhf_populora.__version__
