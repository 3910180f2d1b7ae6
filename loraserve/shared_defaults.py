"""Defaults that two roles share: an address one role binds and another connects to, and the settings
`loraserve up` sets in several roles with one flag (which must start from one default everywhere).

Each is written here once and imported by the roles' configurations (`*/config.py`).
"""

from __future__ import annotations

from pathlib import Path

SCHEDULER_ADDRESS = "127.0.0.1:7100"  # the scheduler's gRPC port: it binds it, gateways call it
SCHEDULER_WORKER_ADDRESS = "tcp://127.0.0.1:7101"  # the scheduler's ZMQ port: it binds it, workers connect to it
STORE_ADDRESS = "127.0.0.1:7300"  # the adapter store's gRPC port: it binds it, gateways call it
STORE_DATA_ADDRESS = "tcp://127.0.0.1:7301"  # the adapter store's ZMQ data port: it binds it, workers fetch from it

ADAPTER_ROWS = True  # the store packs adapters in the workers' pool row layout, and workers fetch those
SHARED_MEMORY_ROOT = Path("/dev/shm")  # where the store keeps those rows and workers on its host map them
PREFETCH_DEPTH = 16  # queued requests the scheduler and each worker look at when predicting adapters
