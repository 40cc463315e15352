"""pyproject.toml lists its packages by hand (the tree maps ir/, cli/, generated/, templates/
under the fp4gen namespace). A package folder missing from that list is absent from a wheel or a
non-editable install and fails only there (the editable install CI uses finds it anyway), so
compare the list with the folders that hold an __init__.py."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_on_disk(package_dir: dict) -> set:
    found = set()
    for top, folder in package_dir.items():  # "fp4gen.ir" = "ir": ir/ and its sub-folders
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join((top, *rel.parts)) if rel.parts else top)
    return found


def test_every_package_folder_is_listed():
    cfg = _config()
    listed = set(cfg["packages"])
    on_disk = _packages_on_disk(cfg["package-dir"])
    assert on_disk - listed == set(), f"package folders missing from pyproject's packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"pyproject lists packages with no folder: {sorted(listed - on_disk)}"


def test_the_check_sees_a_missing_package():
    """Planted fault: drop one listed package; the comparison above must notice."""
    cfg = _config()
    listed = set(cfg["packages"]) - {"fp4gen.device.sm90"}
    assert _packages_on_disk(cfg["package-dir"]) - listed == {"fp4gen.device.sm90"}
