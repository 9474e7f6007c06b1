"""The HTML report in a real browser: headless Chromium (Debian package `chromium`, installed by
.ci/run) loads it, runs its script, and the DOM it ends with has the diverging module marked and its
path opened."""

import copy
import re
import shutil
import subprocess

import pytest

from seekforge.probe.compare import compare_dumps
from seekforge.probe.report import write_report
from tests.probe.test_compare import dump, softmax_scale_bug

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args: str) -> str:
    # --no-sandbox: CI runs as root, where Chromium refuses its sandbox.
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_report_renders_with_divergence_marked(tmp_path, tiny_model, batch):
    buggy = copy.deepcopy(tiny_model)
    softmax_scale_bug(buggy)
    comparison = compare_dumps(dump(buggy, tmp_path / "bad", *batch), dump(tiny_model, tmp_path / "good", *batch))
    page = write_report(comparison, tmp_path / "report.html")
    dom = chromium("--dump-dom", page.as_uri())
    assert 'data-rendered="true"' in dom  # the inline script ran to its end
    marked = re.findall(r'<details class="([^"]*)" data-module="([^"]*)"(?: id="[^"]*")?( open="")?>', dom)
    diverging = [(cls, name, is_open) for cls, name, is_open in marked if "first-diverging" in cls]
    assert diverging == [("node fail first-diverging", "layers.1.self_attn", ' open=""')]
    # The script opened exactly the path from the root down to it.
    opened = {name for _, name, is_open in marked if is_open}
    assert opened == {"", "layers", "layers.1", "layers.1.self_attn"}
    assert "first divergence (forward, call 0)" in dom
