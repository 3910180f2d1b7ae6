"""Supervising the roles of `loraserve up`: a role that exits or stops answering is restarted.

Two parts, as everywhere in loraserve: a pure policy and the loop doing I/O.

`RestartPolicy` (no processes, no clock of its own) decides, per role, when a dead role may be
started again — after an exponential backoff (`backoff_s`, doubling up to `max_backoff_s`, reset
once a role has stayed up `stable_after_s`) — and when restarting is pointless: more than
`max_restarts` restarts of one role within `window_s` is a crash loop, and the stack gives up with
a message naming the role.

`Supervisor` owns the child processes. Each `tick()` (the launcher calls it about twice a second)
restarts roles that exited, checks the gRPC health of roles that serve it (store, scheduler,
gateway), and kills a role that has not answered `unhealthy_after` checks in a row once its
start-up grace period is over, so it is restarted like a crashed one. Any answer counts as alive:
a gateway says NOT_SERVING while no worker is ready, which is no reason to restart it. Workers have
no gRPC server: the scheduler notices a silent worker and stops placing on it; the supervisor
restarts one that exits.

`stop()` drains the stack in order: roles are stopped group by group (`Role.stop_group`: the
gateway first, so it refuses new requests and lets its streams finish; then the workers; then the
scheduler and the store), each group given SIGTERM together and waited for before the next.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.errors import InvalidConfigError

log = logging.getLogger(__name__)


class CrashLoop(RuntimeError):
    """A role keeps dying: restarting it again would not help."""


@dataclass(frozen=True)
class SupervisionConfig:
    backoff_s: float = 0.5  # the first restart's delay; doubles per restart in a row
    max_backoff_s: float = 10.0
    stable_after_s: float = 30.0  # a role up this long has its backoff reset
    max_restarts: int = 5  # more restarts than this within window_s is a crash loop
    window_s: float = 60.0
    health_interval_s: float = 1.0
    unhealthy_after: int = 3  # consecutive failed health checks that count as dead
    startup_grace_s: float = 120.0  # no health verdict before a (re)started role had this long

    def __post_init__(self) -> None:
        if min(self.backoff_s, self.max_backoff_s, self.window_s, self.health_interval_s) <= 0:
            raise InvalidConfigError(f"supervision delays must be positive: {self}")
        if self.max_restarts < 1 or self.unhealthy_after < 1:
            raise InvalidConfigError(f"max_restarts and unhealthy_after must be at least 1: {self}")


@dataclass
class _RoleState:
    started: float
    restarts: deque[float] = field(default_factory=deque)  # when each recent restart happened
    delay: float = 0.0
    died: float | None = None


class RestartPolicy:
    """When may a role that died be started again? A pure object: time is passed in."""

    def __init__(self, config: SupervisionConfig) -> None:
        self.config = config
        self._roles: dict[str, _RoleState] = {}

    def started(self, role: str, now: float) -> None:
        state = self._roles.setdefault(role, _RoleState(now))
        state.started, state.died = now, None

    def died(self, role: str, now: float) -> float:
        """Record a death; returns the delay before the restart. Raises CrashLoop past the limit."""
        state = self._roles[role]
        if state.died is not None:
            return state.delay
        c = self.config
        if now - state.started >= c.stable_after_s:
            state.delay = 0.0
        state.delay = min(c.max_backoff_s, state.delay * 2 if state.delay else c.backoff_s)
        state.died = now
        while state.restarts and now - state.restarts[0] > c.window_s:
            state.restarts.popleft()
        if len(state.restarts) >= c.max_restarts:
            raise CrashLoop(
                f"{role} died {len(state.restarts) + 1} times within {c.window_s:.0f} s; not restarting it again"
            )
        state.restarts.append(now)
        return state.delay

    def up_for(self, role: str, now: float) -> float:
        """Seconds since the role was last started."""
        return now - self._roles[role].started

    def restart_due(self, role: str, now: float) -> bool:
        state = self._roles[role]
        return state.died is not None and now - state.died >= state.delay


@dataclass(frozen=True)
class Role:
    name: str
    command: list[str]
    health_address: str | None = None  # host:port of its gRPC health service, if it has one
    stop_group: int = 0  # stop() stops lower groups first, and waits for them
    health_channel: Callable[[str], grpc.Channel] = grpc.insecure_channel  # a TLS gateway: a secure channel

    def check_health(self, timeout_s: float = 1.0) -> health_pb2.HealthCheckResponse.ServingStatus:
        """Its health service's answer; raises grpc.RpcError when it does not answer."""
        assert self.health_address is not None, f"{self.name} has no health service"
        with self.health_channel(self.health_address) as channel:
            request = health_pb2.HealthCheckRequest()
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s).status


class Supervisor:
    """Starts, watches, restarts and stops the roles (in start order; stopped in reverse)."""

    def __init__(
        self,
        roles: list[Role],
        config: SupervisionConfig | None = None,
        env: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.roles = {role.name: role for role in roles}
        self.config = config or SupervisionConfig()
        self.policy = RestartPolicy(self.config)
        self.env = env  # None: this process's environment as it is at each (re)start
        self.clock = clock
        self.children: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = dict.fromkeys(self.roles, 0)
        self._failed_checks: dict[str, int] = dict.fromkeys(self.roles, 0)
        self._last_check = 0.0

    def start(self) -> None:
        for name in self.roles:
            self._spawn(name)

    def dead(self) -> list[str]:
        """Roles whose process has exited (and not been restarted yet), with their exit codes."""
        return [f"{n} (exit code {p.returncode})" for n, p in self.children.items() if p.poll() is not None]

    def tick(self) -> None:
        """Restart what died, when its backoff allows; kill what stopped answering. Raises CrashLoop."""
        now = self.clock()
        for name, process in self.children.items():
            if process.poll() is None:
                continue
            delay = self.policy.died(name, now)
            if self.policy.restart_due(name, now):
                log.warning("%s exited with code %s; restarting it", name, process.returncode)
                self.restarts[name] += 1
                self._spawn(name)
            elif delay:
                log.debug("%s exited; restarting in %.1f s", name, delay)
        if now - self._last_check >= self.config.health_interval_s:
            self._last_check = now
            self._check_health(now)

    def restart(self, name: str) -> None:
        """Start `name` again now (killing it first if it still runs), outside the restart policy."""
        process = self.children[name]
        if process.poll() is None:
            process.kill()
            process.wait()
        self._spawn(name)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM group by group, each given `timeout_s` to exit before it is killed."""
        for group in sorted({role.stop_group for role in self.roles.values()}):
            names = [n for n, role in self.roles.items() if role.stop_group == group and n in self.children]
            for name in names:
                if self.children[name].poll() is None:
                    self.children[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for name in names:
                try:
                    self.children[name].wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", name, timeout_s)
                    self.children[name].kill()
                    self.children[name].wait()

    # ---- internals -----------------------------------------------------------------------------
    def _spawn(self, name: str) -> None:
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which then drains the
        # roles in order (they still die with it: LORASERVE_DIE_WITH_PARENT).
        env = self.env if self.env is not None else os.environ
        env = {**env, "LORASERVE_DIE_WITH_PARENT": "1", "PYTHONUNBUFFERED": "1"}
        self.children[name] = subprocess.Popen(self.roles[name].command, env=env, start_new_session=True)
        self.policy.started(name, self.clock())
        self._failed_checks[name] = 0
        log.info("started %s (pid %d)", name, self.children[name].pid)

    def _check_health(self, now: float) -> None:
        for name, role in self.roles.items():
            process = self.children.get(name)
            if role.health_address is None or process is None or process.poll() is not None:
                continue
            if self._answers(role):
                self._failed_checks[name] = 0
                continue
            self._failed_checks[name] += 1
            grace_over = self.policy.up_for(name, now) >= self.config.startup_grace_s
            if self._failed_checks[name] >= self.config.unhealthy_after and grace_over:
                log.warning(
                    "%s failed %d health checks in a row; killing it to restart it", name, self._failed_checks[name]
                )
                process.kill()
                process.wait()

    def _answers(self, role: Role) -> bool:
        """Does the role's health service answer at all (SERVING or not)?"""
        try:
            role.check_health()
        except grpc.RpcError:
            return False
        return True
