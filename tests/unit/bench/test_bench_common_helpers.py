"""The helpers several suites share: a quantile in other units, a kernel's check against its reference, and
the systems' last-run numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loraserve.bench.common.stats import quantile
from loraserve.bench.suites.kernels.timing import errors
from loraserve.bench.systems.base import LastRunStats


def test_quantile_scales_before_it_rounds():
    seconds = [0.0301, 0.0402, 0.0503]
    assert quantile(seconds, 0.5, 2, scale=1e3) == round(float(np.quantile(seconds, 0.5)) * 1e3, 2) == 40.2
    assert quantile(seconds, 0.99, 4) == quantile(seconds, 0.99, 4, scale=1.0)
    assert quantile([], 0.5, 2, scale=1e3) is None


def test_errors_judge_relative_error_and_with_atol_closeness_too():
    ref = torch.ones(4, 8)
    max_abs, rel, ok = errors(ref + 1e-3, ref)
    assert math.isclose(max_abs, 1e-3, rel_tol=1e-3) and math.isclose(rel, 1e-3, rel_tol=1e-3) and ok
    assert not errors(ref * 1.5, ref)[2]  # 50 % off
    off = ref.clone()
    off[0, 0] = 1.05  # one element off: not allclose, but the relative error is under 1e-2
    assert errors(off, ref)[2] and errors(off, ref, atol=4e-3)[2]
    tiny = ref * 1e-3  # every element within atol, the relative error far over 1e-2
    assert not errors(tiny + 4e-3, tiny)[2] and errors(tiny + 4e-3, tiny, atol=4e-3)[2]
    assert not errors(ref * 1.02, ref, atol=4e-3)[2]  # 2 %: neither close nor within 1e-2
    assert errors(ref * float("nan"), ref) == (None, None, False)
    assert errors(torch.empty(0, 8), torch.empty(0, 8)) == (0.0, 0.0, True)


def test_a_system_hands_out_a_copy_of_its_last_runs_numbers():
    @dataclass
    class Toy(LastRunStats):
        name: str

    toy = Toy("toy")
    assert toy.stats() == {} and "_stats" not in repr(toy)
    toy._stats = {"steps": 3}
    toy.stats()["steps"] = 4
    assert toy.stats() == {"steps": 3}
