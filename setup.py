"""Which packages the pdserve distribution holds, found rather than listed (everything else is
in pyproject.toml).

Every folder with an ``__init__.py`` under ``pdserve/`` is the package of its dotted path;
``services/`` is re-rooted as ``pdserve.services`` (``services/router/policies`` is
``pdserve.services.router.policies``), so the layout keeps the folder names the design gives
while everything imports under the one name ``pdserve``. A new package is a new folder with an
``__init__.py``: nothing to add here (``tests/test_packaging.py`` checks that none is missed).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
#: Where each re-rooted package's folder is, relative to this file.
PACKAGE_DIR = {"pdserve.services": "services"}


def packages() -> list[str]:
    """Every package of the distribution, sorted: the core's and the services'."""
    core = find_packages(str(ROOT), include=["pdserve", "pdserve.*"])
    services = find_packages(str(ROOT / PACKAGE_DIR["pdserve.services"]))
    return sorted([*core, "pdserve.services", *(f"pdserve.services.{name}" for name in services)])


if __name__ == "__main__":  # setuptools runs this file as __main__; a test imports it
    setup(packages=packages(), package_dir=PACKAGE_DIR)
