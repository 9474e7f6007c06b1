"""`seekforge checkpoint verify RUN_DIR`: check every checkpoint of a run against its manifest.

    seekforge checkpoint verify runs/default       # or RUN_DIR/checkpoints, or one step_* directory

prints one row per checkpoint (status, files, bytes, the first bad file and why) and marks the one
`latest` names; exits 1 when any is damaged or `latest` names none, so scripts can gate a copy or an
upload on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from seekforge.train.checkpoint import latest_checkpoint, latest_pointer_problem, step_dirs
from seekforge.train.integrity import verify


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    v = sub.add_parser("verify", help="check sizes and sha256 of every checkpoint file against its manifest")
    v.add_argument("run_dir", help="a run directory (with checkpoints/), a checkpoints/ directory or one step_* dir")
    v.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="compare sizes only (fast on large checkpoints)")


def checkpoint_dirs(path: Path) -> tuple[list[Path], Path]:
    """The step_* directories under `path` (oldest first) and the checkpoints/ root holding them."""
    if path.name.startswith("step_") and path.is_dir():
        return [path], path.parent
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not root.is_dir():
        raise ValueError(f"{path} is not a directory; pass a run directory such as runs/default")
    dirs = step_dirs(root)[::-1]
    if not dirs:
        raise ValueError(f"no step_* checkpoints under {root}; pass a run directory (the --out-dir of a run)")
    return dirs, root


def run(args) -> None:
    dirs, root = checkpoint_dirs(Path(args.run_dir))
    latest = latest_checkpoint(root, verify=False)
    rows = [("checkpoint", "status", "files", "bytes", "problem")]
    bad = 0
    for d in dirs:
        verdict = verify(d, checksums=args.checksums)
        bad += verdict.status == "corrupt"
        problem = verdict.reason
        if verdict.file is not None:
            problem = f"{verdict.file.name}: {problem}"
        name = d.name + (" (latest)" if latest is not None and d.name == latest.name else "")
        rows.append((name, verdict.status, str(verdict.files), f"{verdict.size:,}", problem))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4])
    print(f"{len(dirs)} checkpoint(s) under {root}: {len(dirs) - bad} usable, {bad} damaged")
    pointer_problem = latest_pointer_problem(root)
    if pointer_problem:  # a resume would not find the checkpoint `latest` promises
        print(pointer_problem)
    if bad or pointer_problem:
        sys.exit(1)
