"""Rank 0's messages to the other ranks (`messages.py`), broadcast over a gloo process group of their own.

A message is two broadcasts from rank 0: its length (int64), then its msgpack bytes (uint8). Adapter rows
go point to point after the message that announces them, each rank receiving its own part only. The group
is gloo even where the collectives of the forward pass run on NCCL, and waits as long as the worker is
idle (`IDLE_TIMEOUT`): a follower spends its life waiting here for the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from loraserve.worker.tensor_parallel.messages import DECODER, ENCODER, Message

IDLE_TIMEOUT = timedelta(days=365)


class Channel:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.sent_bytes = 0  # of messages, counted once however many ranks receive them
        self.rows_sent: dict[int, int] = {}  # rank -> bytes of adapter rows sent to it

    def send(self, message: Message) -> None:
        """Rank 0: `message` to every other rank."""
        payload = ENCODER.encode(message)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)
        self.sent_bytes += len(payload)

    def receive(self) -> Message:
        """Another rank: rank 0's next message."""
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.group)
        payload = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return DECODER.decode(payload.numpy().tobytes())

    def send_rows(self, rows: Sequence[torch.Tensor]) -> None:
        """Rank 0: to each other rank its own rows (rank k: `rows[k - 1]`), all sent at once."""
        sends = []
        for rank, part in enumerate(rows, start=1):
            data = part.contiguous().view(-1).view(torch.uint8)
            sends.append(dist.isend(data, dst=rank, group=self.group))
            self.rows_sent[rank] = self.rows_sent.get(rank, 0) + data.numel()
        for send in sends:
            send.wait()

    def receive_rows(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """Another rank: its rows of the adapter a Load announced."""
        rows = torch.empty(shape, dtype=dtype)
        dist.recv(rows.view(-1).view(torch.uint8), src=0, group=self.group)
        return rows
