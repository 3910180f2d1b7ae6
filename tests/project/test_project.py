"""Project hygiene: committed stubs are current, import names do not clash, compose uses real commands."""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLE_FOLDERS = ["gateway", "scheduler", "adapter_store", "worker", "launcher", "kernels", "bench", "demo", "proto"]


def _setuptools() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_of_python_code_is_an_installed_package():
    """A wheel (the image's install) carries only the packages pyproject lists: a subfolder left out
    installs a loraserve that cannot import it."""
    config = _setuptools()
    folders = {package: ROOT / folder for package, folder in config["package-dir"].items()}
    code = {
        ".".join((package, *d.relative_to(root).parts)).rstrip(".")
        for package, root in folders.items()
        for d in [root, *root.rglob("*")]
        if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))
    }
    assert sorted(code - set(config["packages"])) == []


def test_the_c_kernel_source_is_package_data():
    from fnmatch import fnmatch

    patterns = _setuptools()["package-data"]["loraserve.kernels"]
    sources = [p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels").rglob("*.c")]
    assert sources and all(any(fnmatch(s, pattern) for pattern in patterns) for s in sources)


def test_generated_stubs_match_the_protos(tmp_path):
    from loraserve.protos import OUT, generate

    for path in generate(tmp_path):
        committed = OUT / path.name
        assert committed.is_file(), f"{committed} is missing: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed.name} is stale: run `make protos`"


def test_only_loraserve_is_installed_as_a_top_level_name():
    provided = {name for name, dists in importlib.metadata.packages_distributions().items() if "loraserve" in dists}
    assert provided == {"loraserve"}
    for folder in ROLE_FOLDERS:  # no installed distribution may be shadowed by a folder of this repo
        assert folder not in importlib.metadata.packages_distributions(), (
            f"an installed package provides '{folder}', which the repo's {folder}/ folder would shadow"
        )


def test_repo_folders_never_shadow_installed_packages(tmp_path):
    """Run from the repo root (cwd first on sys.path), an installed `kernels`, `proto`, ... still wins."""
    site = tmp_path / "site"
    for folder in ROLE_FOLDERS:
        (site / folder).mkdir(parents=True)
        (site / folder / "__init__.py").write_text("INSTALLED = True\n")
    code = (
        "import sys; sys.path.append(sys.argv[1]);"
        f"names = {ROLE_FOLDERS!r};"
        "mods = [__import__(n) for n in names];"
        "bad = [n for n, m in zip(names, mods) if not getattr(m, 'INSTALLED', False)];"
        "print('shadowed:', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(site)], cwd=ROOT, check=False, capture_output=True, text=True)
    assert out.stdout.strip() == "shadowed: []", out.stdout + out.stderr[-2000:]


def test_transformers_and_peft_import_beside_the_project_from_the_repo_root():
    code = (
        "import sys, transformers, peft; from transformers.utils import import_utils as u;"
        "from loraserve.kernels import backend; from loraserve.worker import engine;"
        "assert not u.is_kernels_available();"
        "m = sys.modules.get('kernels'); assert m is None or getattr(m, '__file__', None) is None; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_compose_services_run_real_subcommands():
    yaml = pytest.importorskip("yaml")
    from loraserve.cli import COMMANDS, build_parser

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    roles = set()
    for name, service in compose["services"].items():
        if "build" not in service:
            continue  # third-party images (jaeger)
        command = service["command"]
        command = shlex.split(command) if isinstance(command, str) else command
        assert command[0] in COMMANDS, f"service {name} runs unknown subcommand {command[0]!r}"
        parser = build_parser(command[0])
        parser.parse_args(command)  # every flag exists and parses
        (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        flags = {o for action in subcommands.choices[command[0]]._actions for o in action.option_strings}
        for variable in service.get("environment", {}):  # LORASERVE_X_Y is the env twin of --x-y
            assert "--" + variable.removeprefix("LORASERVE_").lower().replace("_", "-") in flags, (name, variable)
        roles.add(command[0])
    assert roles == {"gateway", "scheduler", "adapter-store", "worker", "keys"}  # keys: the one-shot internal keys
    gpu = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert "jaeger" in compose["services"]
    (mount,) = compose["services"]["prometheus"]["volumes"]
    config = yaml.safe_load((ROOT / mount.split(":")[0]).read_text())
    targets = [t for job in config["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]]
    targets += [
        f"{n}:{c['port']}"
        for job in config["scrape_configs"]
        for c in job.get("dns_sd_configs", [])
        for n in c["names"]
    ]
    assert {t.split(":")[0] for t in targets} == roles_services(compose)


def roles_services(compose: dict) -> set[str]:
    """Names of the compose services that run a loraserve role (built from this repo; not one-shot steps)."""
    return {name for name, s in compose["services"].items() if "build" in s and s.get("restart") != "no"}
