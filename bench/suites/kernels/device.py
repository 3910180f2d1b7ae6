"""The device a kernel suite runs on: Triton's interpreter for a dry run, the device's name, versions and bandwidths."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch

from loraserve.bench.suites.kernels.timing import default_bandwidth, measure_bandwidth

PLACEHOLDER_BANDWIDTH_TBS = 1.0  # dry run: no device to measure


def ensure_interpreter() -> None:
    """The dry run needs TRITON_INTERPRET=1 before triton is imported: set it, or refuse if too late."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "run_suite(dry_run=True) runs Triton's interpreter on CPU: set TRITON_INTERPRET=1 before "
            "triton is imported (it already is, without it)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _versions() -> dict[str, str | None]:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def suite_meta(dry_run: bool, device: torch.device) -> dict[str, Any]:
    """Device, versions and bandwidths: measured (GPU), datasheet, and the one the roofline uses."""
    if dry_run:
        name, measured, datasheet = f"cpu ({platform.processor() or platform.machine()})", None, None
    else:
        name = torch.cuda.get_device_name(device)
        measured, datasheet = measure_bandwidth(device), default_bandwidth(name)
    return {
        "device": name,
        "dry_run": dry_run,
        **_versions(),
        "measured_bandwidth_tbs": measured,
        "datasheet_bandwidth_tbs": datasheet,
        "roofline_bandwidth_tbs": measured or PLACEHOLDER_BANDWIDTH_TBS,
        "roofline_bandwidth_is_placeholder": measured is None,
        "roofline_bandwidth_source": "placeholder" if measured is None else "measured",
        "timing": (
            "wall clock, one call, Triton interpreter (not a performance figure)"
            if dry_run
            else "eager: triton do_bench median (L2 flushed); graph: CUDA-graph replay median (L2 flushed)"
        ),
    }
