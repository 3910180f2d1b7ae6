"""`loraserve bench --suite abuse`: the whole stack against hostile and careless clients.

    loraserve bench --suite abuse --out results/abuse            # about 13 minutes (a 10-minute soak)
    loraserve bench --suite abuse --quick --out /tmp/abuse       # about 3 minutes

Starts `loraserve up` (the real supervisor, one worker, the demo model, an auth file with two tenants,
the HTTP API on). The launcher's command as an operator runs it, not `LocalStack`: what the phases count
is the restarts of `up`'s own supervision loop, and `LocalStack` restarts nothing (a role an attack
crashed would stay dead and fail every later phase instead of counting once). The bystander tenant keeps
mixed calls flowing (`probes.Traffic`) while the abuser tenant (and, for the control-plane attacks, a
holder of the internal keys) attacks, one phase after another: `first_structured`, `calm`, `churn` (TCP
connect+close to the scheduler's worker port), `big_body` (2 GiB HTTP bodies), `idle` (thousands of idle
HTTP connections), then the attacks of `attacks.py` (`constraints`, `prompts`, `control`, `batch_hog`),
then `soak`.

For each phase `results.json` records the bystander's calls (by status, latency percentiles, the
longest stretch without a success), the restarts of every role (`probes.Roles`; the gateway's
constraint compilers apart), each role's peak resident memory and open file descriptors, and the
attack's own figures; and the suite's targets (`targets.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import cpu_fields, publish
from loraserve.bench.suites.abuse.attacks import (
    batch_hog,
    constraint_attacks,
    first_structured,
    prompt_flood,
    spoofed_workers,
    submit_flood,
)
from loraserve.bench.suites.abuse.probes import Roles, Traffic, big_body, connection_churn, idle_connections
from loraserve.bench.suites.abuse.targets import targets
from loraserve.client import Client
from loraserve.config_cli import setting
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.gateway.keys import new_key
from loraserve.launcher.ports import free_port_block

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AbusePlan(Preset):
    calm_s: float
    churn_cycles: int
    body_bytes: int
    idle_connections: int
    idle_hold_s: float
    soak_s: float
    soak_threads: int
    constraint_repeats: int = 3  # each attack constraint, per edge
    prompt_flood_s: float = 30.0
    submit_entries: int = 50_000
    spoofed_ids: int = 50
    spoof_s: float = 20.0
    hog_s: float = 60.0


GIB = 1 << 30
#                 calm_s  churn   body     idle    hold_s  soak_s  threads
FULL = AbusePlan(20.0, 10_000, 2 * GIB, 20_000, 45.0, 600.0, 4)
QUICK = AbusePlan(10.0, 3_000, 2 * GIB, 4_000, 20.0, 60.0, 3, 1, 15.0, 50_000, 50, 10.0, 20.0)


@dataclass(frozen=True)
class AbuseSettings:
    """Options of this suite (the bench's --quick and --out apply); None: the preset's."""

    abuse_soak_s: float | None = setting(None, "abuse suite: the soak's seconds")
    abuse_idle_connections: int | None = setting(None, "abuse suite: idle HTTP connections held at once")


SETTINGS = AbuseSettings


class _Stack:
    """`loraserve up` as a child process, its log in `workdir`."""

    def __init__(self, workdir: Path):
        self.key, digest = new_key()  # the abuser's
        self.bystander_key, bystander_digest = new_key()
        auth = workdir / "auth.toml"
        auth.write_text(
            "".join(
                f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{d}"]\nscopes = ["generate"]\n'
                for name, d in (("abuser", digest), ("bystander", bystander_digest))
            )
        )
        self.internal_keys = workdir / "data.internal-keys"  # where `up` makes them, beside its data dir
        self.base = free_port_block(7)
        self.grpc = f"127.0.0.1:{self.base + 5}"
        self.http = f"127.0.0.1:{self.base + 6}"
        command = [sys.executable, "-m", "loraserve.cli", "up", "--base-port", str(self.base), "--bind", self.grpc]
        command += ["--http-bind", self.http, "--auth-file", str(auth), "--data-dir", str(workdir / "data")]
        self.log_path = workdir / "up.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        with Client(self.grpc, api_key=self.key) as client:
            while time.time() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"loraserve up exited ({self.process.returncode}); see {self.log_path}")
                try:
                    client.generate("ready", max_new_tokens=1, timeout=10)
                    return
                except Exception:  # not up yet
                    time.sleep(1.0)
        raise RuntimeError(f"the stack was not ready in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def _phase(name: str, traffic: Traffic, roles: Roles, action) -> dict:
    """Run `action()` (returns the attack's own figures) while traffic flows; the phase's record."""
    restarts_before = roles.restarts()
    roles.reset_peaks()
    started = time.time()
    log.info("abuse: phase %s", name)
    attack = action()
    ended = time.time()
    roles.sample()
    restarts = {r: n - restarts_before.get(r, 0) for r, n in roles.restarts().items()}
    return {
        "phase": name,
        "seconds": round(ended - started, 1),
        "attack": attack,
        "traffic": traffic.window(started, ended),
        "restarts": restarts,
        "peak_rss_mb": {r: round(v, 1) for r, v in roles.peak_rss_mb.items()},
        "peak_fds": dict(roles.peak_fds),
    }


def _then_wait(figures: dict, seconds: float) -> dict:
    time.sleep(seconds)
    return figures


def run(plan: AbusePlan, workdir: Path) -> list[dict]:
    stack = _Stack(workdir)
    try:
        stack.wait_ready()
        roles = Roles(stack.process.pid)
        roles.start()
        adapters = ["", *sorted(demo_adapters())]
        traffic = Traffic(stack.grpc, stack.http, stack.bystander_key, adapters, threads=2)
        traffic.start()
        phases = [_phase("first_structured", traffic, roles, lambda: first_structured(stack.grpc, stack.key))]
        phases.append(_phase("calm", traffic, roles, lambda: _then_wait({}, plan.calm_s)))

        def churn() -> dict:
            seconds = connection_churn("127.0.0.1", stack.base + 1, plan.churn_cycles)
            return _then_wait({"cycles": plan.churn_cycles, "seconds": round(seconds, 2)}, max(seconds, 20.0))

        phases.append(_phase("churn", traffic, roles, churn))

        def bodies() -> dict:
            return {
                "without_key": big_body(stack.http, plan.body_bytes, None),
                "with_key": big_body(stack.http, plan.body_bytes, stack.key),
            }

        phases.append(_phase("big_body", traffic, roles, bodies))
        hold = plan.idle_connections, plan.idle_hold_s
        phases.append(_phase("idle", traffic, roles, lambda: idle_connections(stack.http, *hold)))
        phases += _request_attacks(plan, stack, traffic, roles)
        traffic.stop()
        soak = Traffic(stack.grpc, stack.http, stack.bystander_key, adapters, threads=plan.soak_threads)
        soak.start()
        phases.append(_phase("soak", soak, roles, lambda: _then_wait({"threads": plan.soak_threads}, plan.soak_s)))
        soak.stop()
        roles.stop()
        return phases
    finally:
        stack.stop()


def _request_attacks(plan: AbusePlan, stack: _Stack, traffic: Traffic, roles: Roles) -> list[dict]:
    """The phases of attacks carried by requests: constraints, huge prompts, control messages, batches."""
    model = DEMO_MODEL_DIR.name
    repeats = plan.constraint_repeats
    scheduler_grpc, workers = f"127.0.0.1:{stack.base}", f"tcp://127.0.0.1:{stack.base + 1}"

    def control() -> dict:
        return {
            "submit_stream": submit_flood(scheduler_grpc, stack.internal_keys, plan.submit_entries),
            "spoofed_workers": spoofed_workers(workers, stack.internal_keys, plan.spoofed_ids, plan.spoof_s),
        }

    http, grpc, key = stack.http, stack.grpc, stack.key
    return [
        _phase("constraints", traffic, roles, lambda: constraint_attacks(http, grpc, key, model, repeats)),
        _phase("prompts", traffic, roles, lambda: prompt_flood(http, grpc, key, model, plan.prompt_flood_s)),
        _phase("control", traffic, roles, control),
        _phase("batch_hog", traffic, roles, lambda: batch_hog(http, key, model, plan.hog_s)),
    ]


def print_report(phases: list[dict]) -> None:
    header = f"{'phase':<16} {'calls':>6} {'ok':>6} {'failed':>7} {'p99 s':>6} {'longest gap s':>13}"
    print(f"{header}  restarts  compilers replaced  peak RSS MB (gateway)  attack")
    for p in phases:
        t = p["traffic"]
        failed = sum(t["failed"].values())
        restarts = sum(n for role, n in p["restarts"].items() if role != "gateway-constraints")
        replaced = p["restarts"].get("gateway-constraints", 0)
        gateway_rss = p["peak_rss_mb"].get("gateway", 0.0)
        print(
            f"{p['phase']:<16} {t['calls']:>6} {t['ok']:>6} {failed:>7} {t['latency_s']['p99']:>6} "
            f"{t['longest_without_success_s']:>13}  {restarts:>8}  {replaced:>18}  {gateway_rss:>21}  "
            f"{json.dumps(p['attack'])}"
        )


def main(args: argparse.Namespace) -> int:
    plan = (QUICK if args.quick else FULL).but(soak_s=args.abuse_soak_s, idle_connections=args.abuse_idle_connections)
    with tempfile.TemporaryDirectory(prefix="loraserve-abuse-") as tmp:
        try:
            phases = run(plan, Path(tmp))
        finally:
            if args.out:  # the stack's own log, for whatever the figures show
                os.makedirs(args.out, exist_ok=True)
                shutil.copy(Path(tmp) / "up.log", Path(args.out) / "up.log")
    print_report(phases)
    fields = {"plan": asdict(plan), "phases": phases, "targets": targets(phases)}
    publish(args.out, "abuse", phases, machine_extra=cpu_fields(), **fields)
    return 0
