"""The abuse suite's targets, computed from its phases: what `results.json` says was met or missed.

- no role restarted in any phase (the gateway's constraint compilers apart: replacing one that a
  constraint crashed is the sandbox at work);
- no call of the bystander tenant failed in any phase;
- every attack constraint was answered as a request's own outcome (a 400 / INVALID_ARGUMENT, or an
  answer), never a 5xx, a dropped connection or an unavailable role;
- while 1 MiB prompts flooded the gateway, its health checks answered within HEALTH_S and it never
  said NOT_SERVING;
- the 50,000-entry SubmitStream batch was refused whole, and the scheduler was SERVING after it.
"""

from __future__ import annotations

from loraserve.bench.common.results import target

HEALTH_S = 0.5
OWN_OUTCOMES = frozenset({"200", "400", "OK", "INVALID_ARGUMENT"})  # a constraint's answer, good or refused


def targets(phases: list[dict]) -> list[dict]:
    by_name = {p["phase"]: p for p in phases}
    restarts = sum(n for p in phases for role, n in p["restarts"].items() if role != "gateway-constraints")
    failed = sum(sum(p["traffic"]["failed"].values()) for p in phases)
    out = [
        target("role restarts", "0", restarts, restarts == 0),
        target("bystander calls failed", "0", failed, failed == 0),
    ]
    if "constraints" in by_name:
        answers = {
            status
            for constraint in by_name["constraints"]["attack"].values()
            for edge in constraint.values()
            for status in edge["answers"]
        }
        foreign = sorted(answers - OWN_OUTCOMES)
        out.append(target("constraint answers other than 400 or an answer", "none", foreign, not foreign))
    if "prompts" in by_name:
        attack = by_name["prompts"]["attack"]
        slowest = max(attack["http_health"]["max_s"], attack["grpc_health"]["max_s"])
        ok = slowest <= HEALTH_S and attack["not_serving"] == 0
        out.append(target("slowest health check under 1 MiB prompts (s)", f"<= {HEALTH_S}", slowest, ok))
    if "control" in by_name:
        flood = by_name["control"]["attack"]["submit_stream"]
        whole = set(flood["outcome"]) == {"INVALID_ARGUMENT"} and flood["health_after"] == "SERVING"
        out.append(
            target("50,000-entry SubmitStream batch", "refused whole, scheduler SERVING", flood["outcome"], whole)
        )
    return out
