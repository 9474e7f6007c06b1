"""The README's serving snippets run as written: a server started in the background (`seekforge serve
... &`) is waited for on /health before the next command talks to it (issue 41, bug 12: the client ran
before the server listened and ended in a connection-error traceback)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _bash_blocks() -> list[list[str]]:
    return [block.splitlines() for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)]


def test_a_backgrounded_server_is_waited_for():
    started = 0
    for lines in _bash_blocks():
        for i, line in enumerate(lines):
            if re.match(r"\s*(torchrun .*)?seekforge serve .*&\s*(#.*)?$", line):
                started += 1
                following = lines[i + 1] if i + 1 < len(lines) else ""
                assert re.search(r"until curl .*/health", following), \
                    f"README: {line.strip()!r} is followed by {following.strip()!r}, not a wait on /health"
    assert started, "the README starts no server in the background; update this test"
