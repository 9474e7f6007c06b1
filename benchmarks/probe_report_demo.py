"""The picture in docs/probe_report.png: `seekforge probe`'s HTML report for a wrong softmax scale
planted in layer 1 of a copy of a tiny model (the case tests/probe/test_compare.py checks), taken
with headless Chromium.

    PYTHONPATH=. python benchmarks/probe_report_demo.py [--out docs/probe_report.png]
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import tempfile
from pathlib import Path

import torch

from seekforge.config import ModelConfig
from seekforge.model.model import build_model
from seekforge.probe.compare import compare_dumps
from seekforge.probe.report import write_report
from tests.probe.conftest import SEQ_LEN, SIZES, randomize_
from tests.probe.test_compare import dump, softmax_scale_bug


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/probe_report.png")
    args = parser.parse_args()
    model = randomize_(build_model(ModelConfig(**SIZES))).eval()
    buggy = copy.deepcopy(model)
    softmax_scale_bug(buggy)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (2, SEQ_LEN), generator=gen)
    weights = torch.randn(2, SEQ_LEN, SIZES["vocab_size"], generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        comparison = compare_dumps(dump(buggy, Path(tmp) / "bad", ids, weights),
                                   dump(model, Path(tmp) / "good", ids, weights))
        print(comparison.summary())
        page = write_report(comparison, Path(tmp) / "report.html",
                            "planted bug: softmax scale ×1.25 in layers.1 vs the original")
        subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1100,760", f"--screenshot={Path(args.out).resolve()}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)
    print(f"screenshot: {args.out}")


if __name__ == "__main__":
    main()
