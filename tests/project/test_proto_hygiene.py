"""Proto hygiene: `buf lint` passes on the protos, and `buf breaking` fails on changes that break clients
of the last release of loraserve.v1 (proto/releases), naming the change.

`make proto-check` (part of `make test`) runs the same two checks on the real tree; these tests also
prove that the checks can fail. buf comes from npm (node_modules, installed by `make proto-check`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "node_modules" / ".bin" / "buf"
RELEASES = ROOT / "proto" / "releases"


def buf() -> Path:
    """The buf CLI; outside CI a checkout without it skips, in CI (CI=true) it must be there."""
    if BUF.exists():
        return BUF
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{BUF.relative_to(ROOT)} is missing in CI: `make test` installs it (make proto-check)")
    pytest.skip(f"{BUF.relative_to(ROOT)} is not installed: `make proto-check` installs it with npm")


def last_release() -> Path:
    """The newest baseline in proto/releases, the one the Makefile's PROTO_BASELINE picks (sort -V)."""
    baselines = list(RELEASES.glob("loraserve-*.json"))
    assert baselines, "no release baseline in proto/releases: `make proto-release VERSION=...`"
    return max(baselines, key=lambda path: [int(n) for n in re.findall(r"\d+", path.stem)])


def run_buf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(buf()), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of buf.yaml and the proto sources, to change."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "proto" / "loraserve", tmp_path / "proto" / "loraserve")
    return tmp_path


def edit(tree: Path, name: str, old: str, new: str) -> None:
    path = tree / "proto" / "loraserve" / "v1" / name
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {name} once: update this test"
    path.write_text(text.replace(old, new))


def test_lint_passes_on_the_protos():
    out = run_buf("lint", cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_protos_are_compatible_with_the_last_release():
    out = run_buf("breaking", "--against", str(last_release()), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_lint_fails_on_an_undocumented_message(tree):
    path = tree / "proto" / "loraserve" / "v1" / "gateway.proto"
    path.write_text(path.read_text() + "\nmessage Undocumented {}\n")
    out = run_buf("lint", cwd=tree)
    assert out.returncode != 0
    assert 'Message "Undocumented" should have a non-empty comment' in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("name", "old", "new", "reported"),
    [
        pytest.param(
            "common.proto",
            "  uint32 top_k = 2;\n",
            "",
            'Previously present field "2" with name "top_k" on message "SamplingParameters" was deleted.',
            id="field deleted",
        ),
        pytest.param(
            "scheduler.proto",
            "uint32 queue_position = 1;",
            "uint32 queue_position = 3;",
            'Previously present field "1" with name "queue_position" on message "SubmitResponse" was deleted.',
            id="field renumbered",
        ),
        pytest.param(  # the same bytes on the wire, but generated code and JSON name the field
            "gateway.proto",
            "string client_request_id = 8;",
            "string client_id = 8;",
            'Field "8" on message "GenerateRequest" changed name from "client_request_id" to "client_id".',
            id="field renamed",
        ),
        pytest.param(
            "gateway.proto",
            "  rpc Tokenize(TokenizeRequest) returns (TokenizeResponse);\n",
            "",
            'Previously present RPC "Tokenize" on service "LoraServe" was deleted.',
            id="rpc deleted",
        ),
    ],
)
def test_breaking_fails_naming_the_change(tree, name, old, new, reported):
    edit(tree, name, old, new)
    out = run_buf("breaking", "--against", str(last_release()), cwd=tree)
    assert out.returncode != 0, "buf breaking accepted a breaking change"
    assert reported in out.stdout, out.stdout + out.stderr


def test_breaking_allows_a_new_field(tree):
    edit(
        tree,
        "gateway.proto",
        "  uint32 failovers = 10;\n",
        "  uint32 failovers = 10;\n  // A new field: old clients skip it.\n  uint32 added = 999;\n",
    )
    out = run_buf("breaking", "--against", str(last_release()), cwd=tree)
    assert out.returncode == 0, out.stdout + out.stderr
