"""pyproject.toml lists its packages by hand (patches/ installs as openrlhf_populora.patches): the list must
match the package folders on disk, or a wheel would silently ship without a subpackage."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+



def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_on_disk(folder: Path, name: str) -> set[str]:
    found = set()
    for init in folder.rglob("__init__.py"):
        rel = init.parent.relative_to(folder)
        found.add(".".join((name, *rel.parts)) if rel.parts else name)
    return found


def test_every_package_folder_is_listed_and_every_listed_package_exists():
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    remapped = setuptools["package-dir"]
    on_disk = _packages_on_disk(ROOT / "openrlhf_populora", "openrlhf_populora")
    for package, folder in remapped.items():
        on_disk |= _packages_on_disk(ROOT / folder, package)
    assert listed == on_disk, {"not listed": sorted(on_disk - listed), "listed, no folder": sorted(listed - on_disk)}


def test_the_upstream_lock_ships_with_the_patches_package():
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "*.json" in data["openrlhf_populora.patches.openrlhf_0_11_2"]
    assert (ROOT / "patches" / "openrlhf_0_11_2" / "upstream.lock.json").is_file()


def test_patches_import_under_their_installed_name():
    from openrlhf_populora.patches import openrlhf_0_11_2

    assert Path(openrlhf_0_11_2.__file__).resolve().parent == ROOT / "patches" / "openrlhf_0_11_2"
