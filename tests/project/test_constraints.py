"""constraints.txt pins the development environment `make setup` installs: every dependency pyproject.toml
names (the `dev` extra's included) has one pin there, inside pyproject's range, so that a checkout and CI
install the same versions and a library's new release changes nothing until the file is rewritten
(`make lock`). torch and triton are left to TORCH in the Makefile."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LEFT_TO_TORCH = {"torch", "triton"}
INSTALLERS = {"pip", "setuptools", "uv"}


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip(), f"constraints.txt:{number}: {line!r} is not NAME==VERSION"
        key = canonicalize_name(name)
        assert key not in pins, f"constraints.txt:{number}: {name} pinned twice"
        pins[key] = Version(version.strip())
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = [*project["dependencies"], *extras["dev"]]
    return [r for r in map(Requirement, named) if r.marker is None or r.marker.evaluate()]


def test_every_dependency_is_pinned_inside_its_range():
    pins = _pins()
    for requirement in _requirements():
        key = canonicalize_name(requirement.name)
        if key in LEFT_TO_TORCH:
            continue
        assert key in pins, f"{requirement.name} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(pins[key], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pins[key]}, outside pyproject's {requirement}"
        )


def test_torch_triton_and_the_installers_are_not_pinned():
    assert not (LEFT_TO_TORCH | INSTALLERS) & set(_pins()), "TORCH in the Makefile picks these"
