"""The constraint sandbox (`gateway/constraints.py`): structured-output constraints compiled in child processes.

Real child processes on the demo model's tokenizer. A constraint that crashes llguidance (a chain of
3,000 Lark rules: SIGSEGV), runs past the time bound or past the memory bound is refused
INVALID_ARGUMENT naming its field, its child is replaced and the next constraint compiles; outcomes
are cached (refusals too) and shared by requests asking at once; the wait is bounded; the event loop
keeps running while a child compiles; children carry their title and die with their parent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.constraints import ConstraintConfig, ConstraintSandbox, ConstraintsBusyError, TokenizerSpec
from loraserve.structured import Constraint
from loraserve.tokenizer import Tokenizer

NESTED_REPETITION = "(x{1000}){1000}"  # burns lexer fuel: ~0.1-0.2 s before its refusal
GOOD = Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}, "guided_json")


def chain_grammar(rules: int = 3000) -> str:
    """`start: r0`, `r0: r1 | "x0"`, ...: compiling it recurses once per rule (SIGSEGV in-process at 3,000)."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} | "x{i}"' for i in range(rules)), f'r{rules}: "end"'])


@pytest.fixture(scope="module")
def spec() -> TokenizerSpec:
    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    return TokenizerSpec(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def run(spec: TokenizerSpec, scenario, **config):
    """`scenario(sandbox)` on a started sandbox of `config`, closed afterwards."""

    async def main():
        sandbox = ConstraintSandbox(spec, ConstraintConfig(**config))
        await sandbox.start()
        try:
            return await scenario(sandbox)
        finally:
            await sandbox.close()

    return asyncio.run(main())


async def refusal(sandbox: ConstraintSandbox, constraint: Constraint) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        await sandbox.compile(constraint)
    assert caught.value.field == constraint.field and caught.value.status == "INVALID_ARGUMENT"
    return caught.value


def test_a_constraint_that_crashes_the_compiler_is_refused_and_its_child_replaced(spec):
    async def scenario(sandbox: ConstraintSandbox):
        before = sandbox.pids
        started = time.monotonic()
        error = await refusal(sandbox, Constraint("grammar", chain_grammar(), "guided_grammar"))
        assert "SIGSEGV" in str(error) and time.monotonic() - started < 5
        assert await sandbox.compile(GOOD)  # a child serves it: the survivor or the replacement
        for _ in range(500):  # the replacement starts in the background
            if len(sandbox.pids) == 2 and sandbox.pids != before:
                break
            await asyncio.sleep(0.01)
        assert len(sandbox.pids) == 2 and len(set(sandbox.pids) - set(before)) == 1
        assert sandbox.stats["crashed"] == 1 and sandbox.stats["started"] == 3
        for _ in range(2):  # each child compiles again
            assert await sandbox.compile(Constraint("regex", f"[a-z]{{{_ + 1}}}", "guided_regex"))

    run(spec, scenario, constraint_workers=2)


def test_a_constraint_over_the_time_bound_is_refused_and_its_child_killed(spec):
    async def scenario(sandbox: ConstraintSandbox):
        [before] = sandbox.pids
        error = await refusal(sandbox, Constraint("regex", NESTED_REPETITION, "guided_regex"))
        assert "took longer than 0.01 s to compile" in str(error)
        assert sandbox.stats["timed_out"] == 1
        with pytest.raises(ProcessLookupError):  # killed (and reaped) within a few seconds
            for _ in range(500):
                os.kill(before, 0)
                await asyncio.sleep(0.01)
        sandbox.config = dataclasses.replace(sandbox.config, constraint_timeout=10.0)  # room for the next one
        assert await sandbox.compile(GOOD)
        assert sandbox.pids != [before]

    run(spec, scenario, constraint_workers=1, constraint_timeout=0.01)


def test_a_constraint_over_the_memory_bound_is_refused_and_its_child_replaced(spec):
    async def at_rest(sandbox: ConstraintSandbox) -> int:
        status = Path(f"/proc/{sandbox.pids[0]}/status").read_text()  # its tokenizer built, nothing compiled
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize"))) // 1024

    rest_mib = run(spec, at_rest, constraint_workers=1, constraint_memory_mib=0)

    async def scenario(sandbox: ConstraintSandbox):
        assert await sandbox.compile(GOOD)  # the bound leaves room for an ordinary constraint
        error = await refusal(sandbox, Constraint("regex", NESTED_REPETITION, "sampling.structured_output.regex"))
        assert "memory" in str(error) and sandbox.stats["crashed"] == 1
        assert await sandbox.compile(Constraint("regex", "[0-9]+", "guided_regex"))
        assert sandbox.stats["started"] == 2

    # 32 MiB above a child at rest: room for an ordinary check (a few MiB), none for the ~64 MiB the
    # nested repetition allocates before its lexer runs out of fuel
    run(spec, scenario, constraint_workers=1, constraint_memory_mib=rest_mib + 32, constraint_timeout=30.0)


def test_a_child_killed_while_idle_is_replaced_without_blaming_the_next_constraint(spec):
    async def scenario(sandbox: ConstraintSandbox):
        [before] = sandbox.pids
        os.kill(before, signal.SIGKILL)
        for _ in range(500):
            if _state(before) == "Z":
                break
            await asyncio.sleep(0.01)
        assert await sandbox.compile(GOOD)
        assert sandbox.pids != [before] and sandbox.stats["crashed"] == 0

    run(spec, scenario, constraint_workers=1)


def test_outcomes_are_cached_refusals_too_and_shared_by_requests_asking_at_once(spec):
    async def scenario(sandbox: ConstraintSandbox):
        same = [Constraint("regex", "[a-c]{3}", "guided_regex") for _ in range(5)]
        grammars = await asyncio.gather(*(sandbox.compile(c) for c in same))
        assert len(set(grammars)) == 1 and sandbox.stats["compiled"] == 1  # one compile for five requests
        assert await sandbox.compile(same[0]) == grammars[0] and sandbox.stats["compiled"] == 1
        poison = chain_grammar()
        await refusal(sandbox, Constraint("grammar", poison, "guided_grammar"))
        started = time.monotonic()
        again = await refusal(sandbox, Constraint("grammar", poison, "sampling.structured_output.grammar"))
        assert time.monotonic() - started < 0.05 and "SIGSEGV" in str(again)  # named for this request
        assert sandbox.stats["crashed"] == 1 and sandbox.stats["cache_hits"] == 2
        # a schema as a dict and as its text are different keys, but both compile once
        assert await sandbox.compile(Constraint("json_schema", '{"type":"object"}', "guided_json"))
        assert await sandbox.compile(Constraint("json_schema", {"type": "object"}, "response_format"))

    run(spec, scenario, constraint_workers=1)


def test_the_cache_forgets_the_least_recent_outcome_first(spec):
    async def scenario(sandbox: ConstraintSandbox):
        for letters in ("[a]+", "[b]+", "[a]+", "[c]+", "[a]+", "[b]+"):
            await sandbox.compile(Constraint("regex", letters, "guided_regex"))
        # [a] stays (used last but two), [b] was pushed out by [c] and compiles again
        assert sandbox.stats["compiled"] == 4 and sandbox.stats["cache_hits"] == 2

    run(spec, scenario, constraint_workers=1, constraint_cache=2)


def test_the_wait_is_bounded(spec):
    async def scenario(sandbox: ConstraintSandbox):
        slow = [sandbox.compile(Constraint("regex", f"({c}{{1000}}){{1000}}", "guided_regex")) for c in "xy"]
        tasks = [asyncio.ensure_future(s) for s in slow]
        await asyncio.sleep(0)  # both are compiling or waiting: one child, one place in the queue
        with pytest.raises(ConstraintsBusyError) as busy:
            await sandbox.compile(GOOD)
        assert busy.value.status == "RESOURCE_EXHAUSTED" and busy.value.retry_after_ms > 0
        assert "--constraint-queue 1" in str(busy.value)
        for task in tasks:
            with pytest.raises(InvalidRequestError):
                await task
        assert await sandbox.compile(GOOD)  # room again

    run(spec, scenario, constraint_workers=1, constraint_queue=1)


def test_the_event_loop_runs_while_a_child_compiles(spec):
    async def scenario(sandbox: ConstraintSandbox):
        gaps, last, done = [], time.monotonic(), asyncio.Event()

        async def ticker():
            nonlocal last
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        started = time.monotonic()
        await refusal(sandbox, Constraint("regex", NESTED_REPETITION, "guided_regex"))
        compiled_in = time.monotonic() - started
        done.set()
        await tick
        assert compiled_in > 0.05 and max(gaps) < compiled_in / 2, (compiled_in, max(gaps))

    run(spec, scenario, constraint_workers=1)


def test_children_carry_their_title_and_die_with_their_parent(spec, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import asyncio, sys\n"
        "from loraserve.gateway.constraints import ConstraintSandbox, TokenizerSpec\n"
        "from loraserve.demo.assets import DEMO_MODEL_DIR\n"
        "from loraserve.tokenizer import Tokenizer\n"
        "async def main():\n"
        "    t = Tokenizer.from_model_dir(DEMO_MODEL_DIR)\n"
        "    sandbox = ConstraintSandbox(TokenizerSpec(t.to_json(), t.vocab_size, t.eos_token_ids))\n"
        "    await sandbox.start()\n"
        "    print(*sandbox.pids, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        for pid in pids:
            assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"loraserve-gateway-constraints")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        time.sleep(0.05)
    assert not alive, f"children {alive} outlived their parent"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_flags_are_checked():
    for bad in (
        {"constraint_workers": 0},
        {"constraint_queue": -1},
        {"constraint_timeout": 0},
        {"constraint_memory_mib": 10},
        {"constraint_cache": -1},
    ):
        with pytest.raises(Exception, match="--constraint-"):
            ConstraintConfig(**bad)
