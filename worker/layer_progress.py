"""How far a background copy of an adapter into the pool has got, layer by layer.

The pool copies an adapter's rows layer 0 first (`UnifiedPool`), and marks each layer done. A step that
uses the adapter before its copy finished waits per layer (`wait_layer`, called by the model before each
decoder layer): its prefill computes layer 0 while layer 1 is copied, and so on. A layer's LoRA never reads
rows that are not in the pool yet, so the outputs are those of a step that waited for the whole copy.

On the CPU the copy runs on a thread and `wait_layer` blocks on a condition; on CUDA the copies are queued
on the pool's copy stream with one event per layer, and `wait_layer` makes the current stream wait for that
layer's event (the host never blocks).
"""

from __future__ import annotations

import threading
import time

import torch


class LayerProgress:
    """Layers [0, ready) of one adapter's rows are in the pool; the copy owns `layer_done` / `failed`."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self._cuda = device.type == "cuda"
        self._events = [torch.cuda.Event() for _ in range(num_layers)] if self._cuda else []
        self._ready = 0
        self._landed = [False] * num_layers  # copies may land out of order (CPU: several copy threads)
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self.waited_s = 0.0  # how long steps blocked on this copy (CPU), for the requests' adapter wait time

    # ---- the copy's side -----------------------------------------------------------------------
    def layer_done(self, layer: int) -> None:
        """Layer `layer` is copied (on CUDA: once the copy stream gets to here, layers in order)."""
        if self._cuda:
            self._events[layer].record()
        with self._changed:
            self._landed[layer] = True
            while self._ready < self.num_layers and self._landed[self._ready]:
                self._ready += 1
            self._changed.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    # ---- the step's side -----------------------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        """Return once a step may read `layer`'s rows (CUDA: the current stream waits instead)."""
        if self._cuda:
            torch.cuda.current_stream().wait_event(self._events[layer])
            return
        if self._ready > layer:
            return
        start = time.perf_counter()
        with self._changed:
            while self._ready <= layer and self._error is None:
                self._changed.wait()
        self.waited_s += time.perf_counter() - start
        if self._error is not None:
            raise RuntimeError(f"copying the adapter into the pool failed: {self._error}") from self._error

    def wait_all(self) -> None:
        for layer in range(self.num_layers):
            self.wait_layer(layer)

    def join(self) -> None:
        """Block until the copy ended, done or failed, without raising (before its pages are freed). On CUDA
        nothing to wait for: work queued later on the pages' stream runs after it."""
        if self._cuda:
            return
        with self._changed:
            while self._ready < self.num_layers and self._error is None:
                self._changed.wait()

    def done(self) -> bool:
        """The whole copy finished (CUDA: on the device too)."""
        if self._cuda:
            return self._ready == self.num_layers and self._events[-1].query()
        return self._ready == self.num_layers or self._error is not None
