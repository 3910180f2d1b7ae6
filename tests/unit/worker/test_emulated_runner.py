"""The emulated runner (`--runner emulated`): deterministic tokens, masks, log-probabilities, its wait,
its profile's errors, and its fidelity to the real engine's step times on the calibration workload."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import msgspec
import pytest
from emulated import ADAPTERS, MODEL, emulated_engine, fixed_profile

from loraserve.bench.common.calibration import TINY_GRID
from loraserve.bench.common.profile_fit import write_profile
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidConfigError
from loraserve.launcher.up import check_runner
from loraserve.structured import grammar_for
from loraserve.worker.config import EngineConfig
from loraserve.worker.emulated.runner import EmulatedRunner, batch_features
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.request import FinishReason
from loraserve.worker.runner_profile import load_profile
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.step_roofline import Roofline
from loraserve.worker.step_scheduler import SampleSpec, SeqChunk

PROMPTS = ["the quiet king", "a river ran through the old town", "the queen"]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    return fixed_profile(tmp_path_factory.mktemp("profile") / "runner_profile.json")


@pytest.fixture(scope="module")
def engine(profile):
    engine = emulated_engine(profile)
    yield engine
    engine.close()


def _requests(sampling: SamplingParams) -> list[GenerateRequest]:
    return [GenerateRequest(prompt=p, adapter=a, sampling=sampling) for p in PROMPTS for a in ADAPTERS]


SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=40),
    "seeded": SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=7),
    "penalized": SamplingParams(max_new_tokens=40, repetition_penalty=1.3, presence_penalty=0.5),
}


def test_no_weights_are_loaded_and_tokens_are_a_function_of_the_sequence(engine, profile):
    assert engine.model is None and isinstance(engine.runner, EmulatedRunner)
    assert engine.base_bytes > 0  # what a real step would read, from the model's shape
    first = engine.generate(_requests(SAMPLINGS["greedy"]))
    again = emulated_engine(profile)  # another worker: the same tokens, whatever shares the batch
    try:
        second = again.generate(_requests(SAMPLINGS["greedy"])[::-1])[::-1]
    finally:
        again.close()
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    special = engine.tokenizer.special_ids()
    for r in first:  # never an EOS or other special token: requests end by their length
        assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 40
        assert not special & set(r.token_ids)
    assert len({tuple(r.token_ids) for r in first}) == len(first), "each (prompt, adapter) its own text"


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_a_request_continued_elsewhere_gets_the_same_tokens(engine, profile, kind):
    """Failover: another engine given the prompt and the tokens so far goes on exactly as the first would."""
    sampling = SAMPLINGS[kind]
    whole = engine.generate(_requests(sampling))
    other = emulated_engine(profile)
    try:
        for cut, result in zip((1, 9, 23, 31, 5, 17, 2, 30, 11), whole, strict=True):
            done = result.token_ids[:cut]
            continued = other.add_request(result.prompt_ids, sampling, result.adapter, output_ids=done)
            while not continued.finished:
                other.step()
            assert continued.output_ids == result.token_ids, (kind, cut, result.adapter)
    finally:
        other.close()


def test_structured_output_masks_are_respected(engine):
    choices = ["the king", "the queen", "a river"]
    constraints = [("choice", choices, lambda t: t in choices), ("regex", r"[a-z]{2,6}( [a-z]{2,6}){2}\.", None)]
    requests, checks = [], []
    for kind, value, check in constraints:
        for sampling in ({}, {"temperature": 1.0, "seed": 3}):
            for adapter in ADAPTERS:
                grammar = grammar_for(kind, value, kind)
                sampled = SamplingParams(max_new_tokens=60, grammar=grammar, **sampling)
                requests.append(GenerateRequest(prompt="the quiet king", adapter=adapter, sampling=sampled))
                checks.append(check or (lambda t, v=value: re.fullmatch(v, t) is not None))
    results = engine.generate(requests + _requests(SAMPLINGS["greedy"]))  # beside unconstrained requests
    for check, result in zip(checks, results, strict=False):
        assert result.finish_reason is FinishReason.STOP and check(result.text), result.text


def test_log_probabilities_are_well_formed(engine):
    sampling = msgspec.structs.replace(SAMPLINGS["seeded"], max_new_tokens=8, logprobs=4, prompt_logprobs=3)
    greedy = msgspec.structs.replace(SAMPLINGS["greedy"], max_new_tokens=8, logprobs=4)
    results = engine.generate(_requests(sampling) + _requests(greedy))
    for result in results:
        assert len(result.logprobs) == 8
        entries = list(result.logprobs) + list(result.prompt_logprobs)
        for entry in entries:
            assert math.isfinite(entry.logprob) and entry.logprob <= 0
            assert all(math.isfinite(v) and v <= 0 for v in entry.top_logprobs)
            assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
            assert sum(math.exp(v) for v in entry.top_logprobs) <= 1 + 1e-5
        for token, entry in zip(result.token_ids, result.logprobs, strict=True):
            if token in entry.top_ids:
                assert entry.logprob == pytest.approx(entry.top_logprobs[entry.top_ids.index(token)], abs=1e-6)
    for result in results[len(results) // 2 :]:  # greedy: the chosen token is the most likely one
        assert all(e.top_ids[0] == t for t, e in zip(result.token_ids, result.logprobs, strict=True))
    for result in results[: len(results) // 2]:
        assert len(result.prompt_logprobs) == len(result.prompt_ids) - 1


def test_a_step_sleeps_its_predicted_time_without_spinning(tmp_path):
    engine = emulated_engine(fixed_profile(tmp_path / "slow.json", step_s=0.05, per_token_s=1e-4))
    runner = engine.runner
    spec = SampleSpec(SamplingParams(), 0, [5, 6, 7], [])
    batch = [SeqChunk(f"r{i}", [5, 6, 7], 0, [i], None, spec) for i in range(4)]
    predicted = runner.profile.runner_s(batch_features(batch))
    assert predicted == pytest.approx(0.05 + 12e-4)
    wall, cpu = time.perf_counter(), time.thread_time()
    output = runner.execute(batch)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert set(output.sampled) == {"r0", "r1", "r2", "r3"} and len(set(output.sampled.values())) == 1
    assert wall >= predicted and cpu < predicted / 2, (wall, cpu)
    assert runner.emulated_seconds == pytest.approx(predicted)
    engine.close()


# ---- the profile -----------------------------------------------------------------------------------
ROOFLINE = {"bandwidth_bytes_s": 1e12, "peak_flops_s": 1e14, "bytes_per": {"const": 1e9}, "flops_per": {"tokens": 1e9}}


def _profile_dict(tmp_path: Path) -> dict:
    return json.loads(fixed_profile(tmp_path / "good.json").read_text())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "not json", "not a valid loraserve runner profile"),
        (lambda d: {**d, "format": "other"}, "format"),
        (lambda d: {**d, "version": 99}, "version 99"),
        (lambda d: {**d, "runner_coef": {"const": 1.0}}, "lack"),
        (lambda d: {**d, "runner_coef": {**d["runner_coef"], "tokens": -1.0}}, "non-negative"),
        (lambda d: {k: v for k, v in d.items() if k != "costs"}, "costs"),
        (lambda d: {**d, "model": {**d["model"], "hidden_size": 4096}}, r"different model.*hidden_size"),
        (lambda d: {**d, "roofline": {**ROOFLINE, "bytes_per": []}}, "bytes_per must be an object"),
        (
            lambda d: {**d, "roofline": {**ROOFLINE, "flops_per": {"tokens": "2"}}},
            r"flops_per\['tokens'\] must be a number",
        ),
        (lambda d: {**d, "roofline": {**ROOFLINE, "peak_flops_s": None}}, "peak_flops_s must be a number"),
        (lambda d: {**d, "roofline": [1, 2]}, "roofline: not an object"),
    ],
)
def test_a_bad_profile_is_refused_saying_how_to_write_one(tmp_path, edit, message):
    edited = edit(_profile_dict(tmp_path))
    path = tmp_path / "bad.json"
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(InvalidConfigError, match=message) as e:
        load_profile(path, MODEL)
    assert "bench --suite runner-profile" in str(e.value)
    with pytest.raises(InvalidConfigError, match=message):  # the engine reads it before loading anything
        Engine(DEMO_MODEL_DIR, EngineConfig(runner="emulated", runner_profile=path))


def test_a_version_1_profile_still_loads(tmp_path):
    """Version 2 added the optional roofline; a version 1 file (none) reads as before."""
    old = {**_profile_dict(tmp_path), "version": 1}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path, MODEL)
    assert profile.roofline is None and profile.runner_coef[0] == pytest.approx(0.002)


def test_a_profile_without_a_roofline_is_written_as_version_1_one_with_as_version_2(tmp_path):
    """Readers of version 1 read a measured profile (no roofline); version 2 is for the roofline alone."""
    plain = load_profile(fixed_profile(tmp_path / "plain.json"), MODEL)
    assert plain.as_dict()["version"] == 1 and _profile_dict(tmp_path)["version"] == 1
    with_roofline = dataclasses.replace(plain, roofline=Roofline.from_dict(ROOFLINE))
    assert with_roofline.as_dict()["version"] == 2
    with_roofline.write(tmp_path / "roofline.json")
    assert load_profile(tmp_path / "roofline.json", MODEL).roofline == with_roofline.roofline


@pytest.mark.parametrize("scale", [0.0, -2.0, math.nan, math.inf])
def test_scaling_by_a_non_positive_or_non_finite_scale_is_refused(tmp_path, scale):
    profile = load_profile(fixed_profile(tmp_path / "p.json"), MODEL)
    with pytest.raises(ValueError, match="time scale"):
        profile.scaled(scale)
    with pytest.raises(ValueError, match="time scale"):
        Roofline.from_dict(ROOFLINE).scaled(scale)


def test_scaling_twice_records_the_product_in_the_fidelity_and_the_roofline(tmp_path):
    profile = load_profile(fixed_profile(tmp_path / "p.json"), MODEL)
    profile = dataclasses.replace(profile, roofline=Roofline.from_dict(ROOFLINE))
    twice = profile.scaled(2.0).scaled(2.0)
    assert twice.fidelity["time_scale"] == 4.0 and twice.roofline.about["time_scale"] == 4.0
    assert twice.runner_coef[0] == pytest.approx(4 * profile.runner_coef[0])


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"needs runner_profile.*--suite runner-profile"):
        EngineConfig(runner="emulated")
    with pytest.raises(InvalidConfigError, match="real or emulated"):
        EngineConfig(runner="fake")
    with pytest.raises(InvalidConfigError, match="runs on the CPU"):
        EngineConfig(runner="emulated", runner_profile=tmp_path / "p.json", device="cuda")
    with pytest.raises(InvalidConfigError, match=r"does not exist.*--suite runner-profile"):
        load_profile(tmp_path / "missing.json", MODEL)
    args = {"runner": "emulated", "runner_profile": None, "model": DEMO_MODEL_DIR, "device": "cpu"}
    with pytest.raises(InvalidConfigError, match="--runner emulated needs --runner-profile"):  # `up`, before any start
        check_runner(argparse.Namespace(**args))
    with pytest.raises(InvalidConfigError, match="does not exist"):
        check_runner(argparse.Namespace(**{**args, "runner_profile": tmp_path / "missing.json"}))
    with pytest.raises(InvalidConfigError, match="runs on the CPU"):
        check_runner(argparse.Namespace(**{**args, "runner_profile": tmp_path / "p.json", "device": "cuda:0,cuda:1"}))


# ---- fidelity ------------------------------------------------------------------------------------
def test_emulated_step_times_are_within_20_percent_of_the_real_engine(tmp_path):
    """The calibration workload through the real engine (thread CPU time) and through an emulated engine
    with the profile fitted to it (wall time): the totals and the median step within 20 %."""
    profile = write_profile(DEMO_MODEL_DIR, dataclasses.replace(TINY_GRID, repeats=3), tmp_path / "profile.json")
    fidelity = profile.fidelity["in_sample"]
    assert fidelity["steps"] > 50
    assert fidelity["total_ratio"] == pytest.approx(1.0, abs=0.2), fidelity
    assert fidelity["median_step_ratio"] == pytest.approx(1.0, abs=0.2), fidelity
    assert fidelity["within_tolerance"]
    assert load_profile(tmp_path / "profile.json", MODEL).fidelity == {"in_sample": fidelity}  # recorded in the file
