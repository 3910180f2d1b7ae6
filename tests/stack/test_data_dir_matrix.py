"""A data dir damaged in every way an operator meets, against real `loraserve adapter-store` processes.

One data dir holds every case at once, each under its own adapter name, so the whole matrix costs
one store that writes it, one that must refuse to start, one restart with lowered limits and one
with the limits raised again:

- a corrupt newest version beside a good older one (a crash between the commit of v2 and the
  removal of v1): v1 keeps serving, v2 goes to quarantine;
- a newest version whose meta.json is missing (an interrupted registration): the same;
- a lone version with no meta.json, truncated weights, or a garbage meta.json: not served, its
  files moved to quarantine/ — never deleted;
- adapters over a lowered --max-adapter-mb or --max-lora-rank: skipped but left in place, served
  again once the limits are raised.

Every such event is logged at WARNING, naming the adapter; a store that refuses to start moves
nothing at all. The data dir a store creates is private (0700, files 0600), and a store started on
a group- or world-readable one says so.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest
from store_proc import StoreProcess, files, upload

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.timeout(120)
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
NO_DEMO = ("--model", str(DEMO_MODEL_DIR), "--no-preload-demo")
LOWERED = ("--max-adapter-mb", "1", "--max-lora-rank", "16")  # reverse is 1.2 MiB, rot13 has rank 64


@dataclass(frozen=True)
class Case:
    name: str
    lowered: int | None  # the version served under the lowered limits (None: not served)
    raised: int | None  # ... and after they are raised again
    quarantined: tuple[str, ...]  # "v<N>/<file>" that must end up below quarantine/
    in_place: tuple[str, ...]  # "v<N>/<file>" that must stay where they are
    warns: tuple[str, ...] = ()  # words a WARNING line naming the adapter must hold (none: no such line)


ALL = (CONFIG, WEIGHTS, "meta.json")
CASES = {
    c.name: c
    for c in (
        Case("ok", 1, 1, (), tuple(f"v1/{f}" for f in ALL)),
        Case(
            "newest",
            1,
            1,
            tuple(f"v2/{f}" for f in ALL),
            tuple(f"v1/{f}" for f in ALL),
            ("newest v2", "quarantine", "does not match"),
        ),
        Case(
            "pending",
            1,
            1,
            (f"v2/{CONFIG}", f"v2/{WEIGHTS}"),
            tuple(f"v1/{f}" for f in ALL),
            ("pending v2", "quarantine", "meta.json"),
        ),
        Case("nometa", None, None, (f"v1/{CONFIG}", f"v1/{WEIGHTS}"), (), ("nometa v1", "quarantine", "meta.json")),
        Case("trunc", None, None, tuple(f"v1/{f}" for f in ALL), (), ("trunc v1", "quarantine", WEIGHTS)),
        Case("garbage", None, None, tuple(f"v1/{f}" for f in ALL), (), ("garbage v1", "quarantine", "meta.json")),
        Case("big", None, 1, (), tuple(f"v1/{f}" for f in ALL), ("big v1", "--max-adapter-mb", "1.0 MiB")),
        Case("deep", None, 1, (), tuple(f"v1/{f}" for f in ALL), ("deep v1", "--max-lora-rank", "16")),
    )
}


@dataclass
class Outcome:
    data: Path
    refused_rc: int | None
    refused_output: str
    tree_before: dict[str, bytes]  # every file of the damaged data dir, before any restart
    tree_after_refusal: dict[str, bytes]
    served_lowered: dict[str, tuple[int, str]]
    served_raised: dict[str, tuple[int, str]]
    log: str  # both restarts' output
    modes: dict[str, tuple[int, bool]]  # (mode, is a directory) of what the first store created
    open_dir_warning: bool  # the restart on a 0755 data dir said so


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _served(store: StoreProcess) -> dict[str, tuple[int, str]]:
    return {name: (info.version, info.sha256) for name, info in store.listed().items()}


def _write_all(tmp: Path, data: Path) -> None:
    """The first store writes every case's versions; a v1 snapshot of 'newest' and 'pending' is kept aside."""
    store = StoreProcess(tmp, *NO_DEMO, "--data-dir", str(data)).wait_serving()
    try:
        for name, adapter in (("ok", "upper"), ("nometa", "upper"), ("trunc", "upper"), ("garbage", "upper")):
            upload(store, name, adapter)
        upload(store, "big", "reverse")
        upload(store, "deep", "rot13")
        for name in ("newest", "pending"):
            upload(store, name, "upper")
            shutil.copytree(data / "adapters" / name / "v1", tmp / f"{name}-v1")
            upload(store, name, "title")  # the store removes v1 once v2 is committed
    finally:
        store.kill()


def _damage(tmp: Path, data: Path) -> None:
    adapters = data / "adapters"
    for name in ("newest", "pending"):  # a crash after v2's commit, before v1's removal
        shutil.copytree(tmp / f"{name}-v1", adapters / name / "v1")
    weights = adapters / "newest" / "v2" / WEIGHTS
    rotten = bytearray(weights.read_bytes())
    rotten[len(rotten) // 2] ^= 0xFF
    weights.write_bytes(bytes(rotten))
    (adapters / "pending" / "v2" / "meta.json").unlink()
    (adapters / "nometa" / "v1" / "meta.json").unlink()
    weights = adapters / "trunc" / "v1" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-100])
    (adapters / "garbage" / "v1" / "meta.json").write_bytes(b"\x00not json at all\xff")


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> Outcome:
    tmp = tmp_path_factory.mktemp("matrix")
    data = tmp / "data"
    _write_all(tmp, data)
    modes = {
        p.relative_to(data).as_posix(): (stat.S_IMODE(p.stat().st_mode), p.is_dir()) for p in [data, *data.rglob("*")]
    }
    _damage(tmp, data)
    before = _tree(data)
    # lowered limits and a budget the good adapters do not fit: the store must refuse, moving nothing
    budget = ("--max-adapter-mb", "0.05", "--memory-budget-gb", "0.00005")
    refused = StoreProcess(tmp, *NO_DEMO, "--data-dir", str(data), *LOWERED[2:], *budget)
    try:
        refused_rc = refused.proc.wait(60)
        refused_output = refused.output()
    finally:
        refused.stop()
    after_refusal = _tree(data)
    data.chmod(0o755)  # an operator's (or an old version's) open data dir
    store = StoreProcess(tmp, *NO_DEMO, "--data-dir", str(data), *LOWERED).wait_serving()
    try:
        served_lowered = _served(store)
    finally:
        store.stop()
    log = store.log.read_text()  # whole: output() is only its tail
    open_dir_warning = any(
        " WARNING " in line and str(data) in line and "chmod 700" in line for line in log.splitlines()
    )
    store = StoreProcess(tmp, *NO_DEMO, "--data-dir", str(data)).wait_serving()
    try:
        served_raised = _served(store)
    finally:
        store.stop()
    return Outcome(
        data,
        refused_rc,
        refused_output,
        before,
        after_refusal,
        served_lowered,
        served_raised,
        log + store.log.read_text(),
        modes,
        open_dir_warning,
    )


def _sha(adapter: str) -> str:
    return hashlib.sha256(files(adapter)[1]).hexdigest()


EXPECTED_WEIGHTS = {"ok": "upper", "newest": "upper", "pending": "upper", "big": "reverse", "deep": "rot13"}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_a_damaged_data_dir_serves_what_is_good_and_deletes_nothing(outcome, case):
    name = case.name
    for served, version in ((outcome.served_lowered, case.lowered), (outcome.served_raised, case.raised)):
        if version is None:
            assert name not in served
        else:
            assert served.get(name) == (version, _sha(EXPECTED_WEIGHTS[name]))
    quarantine = outcome.data / "quarantine"
    for relative in case.quarantined:
        moved = [p for p in quarantine.rglob("*") if p.as_posix().endswith(f"adapters/{name}/{relative}")]
        assert len(moved) == 1, f"{name}/{relative} is not in quarantine"
        assert moved[0].read_bytes() == outcome.tree_before[f"adapters/{name}/{relative}"]
    for relative in case.in_place:
        key = f"adapters/{name}/{relative}"
        assert (outcome.data / key).read_bytes() == outcome.tree_before[key], f"{key} was not left in place"
    mentions = [line for line in outcome.log.splitlines() if re.search(rf"(?<![\w-]){name} v\d", line)]
    loud = [line for line in mentions if " WARNING " in line]
    assert not [line for line in mentions if " INFO " in line and re.search("remov|quarantin|skip", line)]
    if case.warns:
        assert any(all(word in line for word in case.warns) for line in loud), "\n".join(mentions)
    else:
        assert not loud


def test_nothing_in_the_data_dir_is_ever_deleted(outcome):
    left = set(_tree(outcome.data).values())
    lost = [key for key, data in outcome.tree_before.items() if data not in left]
    assert not lost


def test_a_store_that_refuses_to_start_moves_nothing(outcome):
    assert outcome.refused_rc == 1, outcome.refused_output
    assert "budget" in outcome.refused_output
    assert outcome.tree_after_refusal.keys() - {".lock"} == outcome.tree_before.keys() - {".lock"}
    assert all(outcome.tree_after_refusal[k] == v for k, v in outcome.tree_before.items())


def test_the_data_dir_is_private_and_an_open_one_is_reported(outcome):
    assert outcome.modes["."] == (0o700, True)
    for relative, (mode, is_dir) in outcome.modes.items():
        assert mode == (0o700 if is_dir else 0o600), f"{relative}: {oct(mode)}"
    assert outcome.open_dir_warning, outcome.log
