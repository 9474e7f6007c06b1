"""A checkpoint directory crafted to run code when loaded (a pickle payload in DCP's `.metadata`, or
in a non-tensor value) is refused by load_checkpoint; stock torch.distributed.checkpoint runs it.
(Honest checkpoints, optimizer and scheduler state included, load through the same readers in
tests/train/test_checkpoint.py's bitwise resume test.)"""

from __future__ import annotations

import os
import pickle  # noqa: TID251 — writes the malicious payloads this test feeds the loader

import pytest
import torch.distributed.checkpoint as dcp

from seekforge.config import preset
from seekforge.model.model import build_model
from seekforge.train.checkpoint import load_checkpoint, save_checkpoint


class Payload:
    """Unpickling it creates a directory: harmless, and visible."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture
def model():
    return build_model(preset("tiny"), seed=0)


def test_metadata_payload_is_refused(tmp_path, model):
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, model)
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match="not a DCP metadata file"):
        load_checkpoint(ckpt, build_model(model.cfg, seed=1))
    assert not marker.exists()
    with pytest.raises(BaseException):  # noqa: B017 — stock DCP runs the payload, then fails on what it returned
        dcp.load({"model": {}}, checkpoint_id=str(ckpt))
    assert marker.exists()  # so the test above guards a real hole


def test_payload_in_a_non_tensor_value_is_refused(tmp_path, model):
    marker = tmp_path / "pwned"
    path = tmp_path / "step_000001"
    dcp.save({"model": model.state_dict(), "trainer": {"step": Payload(marker)}}, checkpoint_id=str(path))
    with pytest.raises(ValueError, match="cannot be read"):
        load_checkpoint(path, build_model(model.cfg, seed=1))
    assert not marker.exists()
    dcp.load({"trainer": {"step": 0}}, checkpoint_id=str(path))
    assert marker.exists()
