"""`load_model` holds one copy of the weights at a time: each group's checkpoint tensors are freed as soon as
they are packed, so loading peaks at the model plus one group, not twice the model."""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.model_config import ModelConfig
from loraserve.worker import dense, model


def test_packed_projections_leave_no_copy_of_their_checkpoint_tensors(monkeypatch):
    originals: list[StorageWeakRef] = []  # the storage, which the loader's own dict of tensors could keep alive
    still_held: list[int] = []  # at each pack: earlier groups' checkpoint tensors still referenced
    real_init = dense.DenseLinear.__init__

    def recording_init(self, weights, biases):
        gc.collect()
        still_held.append(sum(not ref.expired() for ref in originals))
        originals.extend(StorageWeakRef(w.untyped_storage()) for w in weights)
        real_init(self, weights, biases)

    monkeypatch.setattr(dense.DenseLinear, "__init__", recording_init)
    config = ModelConfig.from_dir(DEMO_MODEL_DIR)
    loaded = model.load_model(DEMO_MODEL_DIR, config, torch.device("cpu"), torch.float32)
    gc.collect()
    assert len(originals) == 7 * config.num_layers  # q, k, v, o, gate, up, down (the demo's output layer is tied)
    assert all(ref.expired() for ref in originals), "a packed projection's checkpoint tensor is still referenced"
    assert still_held == [0] * len(still_held), "packing held earlier groups' checkpoint tensors"
    assert loaded.parameter_count == sum(p.numel() for p in _checkpoint_tensors())


def _checkpoint_tensors():
    from safetensors.torch import load_file

    return load_file(DEMO_MODEL_DIR / "model.safetensors").values()
