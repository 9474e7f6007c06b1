"""The objective (model/loss.py) on packed rows: no target crosses a document boundary."""

import torch

from seekforge.config import preset
from seekforge.model.loss import IGNORE_INDEX, lm_loss, mtp_targets
from seekforge.model.model import build_model


def test_mtp_targets_stop_at_document_ends():
    labels = torch.tensor([[11, 12, 13, IGNORE_INDEX, 21, 22, 23, 24]])  # two documents of 4 tokens
    segment_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    # depth 1: position t predicts labels[t + 1] — only while t + 1 is in t's document
    assert mtp_targets(labels, 1, segment_ids).tolist() == [[12, 13, IGNORE_INDEX, IGNORE_INDEX, 22, 23, 24,
                                                            IGNORE_INDEX]]
    assert mtp_targets(labels, 2, segment_ids).tolist() == [[13, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 23,
                                                            24, IGNORE_INDEX, IGNORE_INDEX]]
    # unpacked rows: only the window's end
    assert mtp_targets(labels, 2).tolist() == [[13, IGNORE_INDEX, 21, 22, 23, 24, IGNORE_INDEX, IGNORE_INDEX]]


def test_packed_row_loss_equals_the_documents_trained_alone():
    """Two documents packed into one row (per-document positions and segment ids, labels ignored at
    the first document's end) give the token-weighted mean of their separate lm and MTP losses."""
    cfg = preset("tiny", num_nextn_predict_layers=2)
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (9, 7)]

    def alone(doc):
        _, parts = lm_loss(model, doc[None, :-1], doc[None, 1:], mtp_loss_scale=1.0)
        return parts

    ids = torch.cat([d[:-1] for d in docs])[None]
    labels = torch.cat([d[1:] for d in docs])[None]
    positions = torch.cat([torch.arange(len(d) - 1) for d in docs])[None]
    segment_ids = torch.cat([torch.full((len(d) - 1,), i) for i, d in enumerate(docs)])[None]
    _, packed = lm_loss(model, ids, labels, positions, segment_ids, mtp_loss_scale=1.0)

    parts = [alone(d) for d in docs]
    lm_counts = [len(d) - 1 for d in docs]
    expected_lm = sum(p["lm_loss"] * n for p, n in zip(parts, lm_counts, strict=True)) / sum(lm_counts)
    torch.testing.assert_close(packed["lm_loss"], expected_lm, rtol=1e-5, atol=1e-6)
    # MTP: the mean over depths of each depth's token mean; depth k has len - 1 - k targets per document.
    per_depth = []
    for k in (1, 2):
        counts = [len(d) - 1 - k for d in docs]
        depth_losses = [depth_loss(model, d, k) for d in docs]
        per_depth.append(sum(l * n for l, n in zip(depth_losses, counts, strict=True)) / sum(counts))
    torch.testing.assert_close(packed["mtp_loss"], torch.stack(per_depth).mean(), rtol=1e-5, atol=1e-6)


def depth_loss(model, doc, k):
    from seekforge.model.loss import mtp_losses

    ids, labels = doc[None, :-1], doc[None, 1:]
    h, rope, mask = model.hidden(ids)
    return mtp_losses(model, h, ids, labels, rope, mask)[k - 1].detach()
