"""The distribution holds every package (``setup.py`` finds them; nothing is listed by hand):
every folder with an ``__init__.py`` under ``pdserve/`` and ``services/`` is found, no folder
of Python files lacks one (it would be left out of a wheel), and a built wheel holds exactly
the packages found, with the ``pdserve`` command; the image copies what the build reads."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    """``setup.py`` as a module (its ``setup()`` call runs only as ``__main__``)."""
    spec = importlib.util.spec_from_file_location("pdserve_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _folders(top: str) -> list[Path]:
    """``top`` and every folder under it, caches aside."""
    below = (d for d in (ROOT / top).rglob("*") if d.is_dir() and d.name != "__pycache__")
    return [ROOT / top, *sorted(below)]


def _package_name(folder: Path) -> str:
    parts = folder.relative_to(ROOT).parts
    if parts[0] == "services":
        parts = ("pdserve", *parts)
    return ".".join(parts)


def test_every_package_folder_is_found() -> None:
    found = set(_setup_module().packages())
    on_disk = {
        _package_name(d)
        for top in ("pdserve", "services")
        for d in _folders(top)
        if (d / "__init__.py").is_file()
    }
    assert on_disk - found == set(), "package folders setup.py does not find"
    assert found - on_disk == set(), "packages setup.py finds that are not folders"
    assert {"pdserve", "pdserve.commands", "pdserve.services", "pdserve.services.router"} <= found


def test_no_folder_of_python_files_lacks_an_init() -> None:
    missing = [
        str(d.relative_to(ROOT))
        for top in ("pdserve", "services")
        for d in _folders(top)
        if any(d.glob("*.py")) and not (d / "__init__.py").is_file()
    ]
    assert missing == [], "folders of Python files without __init__.py (left out of a wheel)"


def test_the_image_copies_what_the_build_reads() -> None:
    copied = {
        name
        for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
        for name in line.split()[1:-1]
    }
    assert {"pyproject.toml", "setup.py", "README.md", "pdserve", "services"} <= copied


@pytest.mark.slow
def test_a_wheel_holds_the_found_packages(tmp_path: Path) -> None:
    # Built from a copy, so setuptools' build/ folder lands there, not in the checkout.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for top in ("pdserve", "services"):
        shutil.copytree(ROOT / top, src / top, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "wheel")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheel").glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == set(_setup_module().packages())
    assert "pdserve/py.typed" in names
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert (
        "pdserve = pdserve.commands.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )
