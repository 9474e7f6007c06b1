"""Checkpoint integrity: a manifest of every file's size and SHA-256, written last at save, checked
at resume and by `seekforge checkpoint verify`.

A checkpoint directory `step_000100/` is complete only if `manifest.json` lists every other file in
it and each file still has the listed size and checksum. The manifest is written after everything
else (temp name, fsync, rename), and the directory is renamed into place after that, so a crash
mid-save can never produce a `step_*` directory whose manifest vouches for missing bytes. What the
manifest catches: a truncated or deleted shard (disk full, a copy cut short), a flipped bit, a file
overwritten by another run. Checkpoints saved before manifests existed load as "unverified".
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
_FORMAT = "seekforge-checkpoint-manifest/1"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt_dir: Path, step: int) -> Path:
    """List every file under `ckpt_dir` (size, sha256) in ckpt_dir/manifest.json, atomically."""
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp")):
        files[path.relative_to(ckpt_dir).as_posix()] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": _FORMAT, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name says the checkpoint is complete
    os.replace(tmp, ckpt_dir / MANIFEST)
    return ckpt_dir / MANIFEST


@dataclass(frozen=True)
class Verdict:
    path: Path
    status: str  # "ok" | "unverified" (no manifest: an older save) | "corrupt"
    file: Path | None = None  # the first bad file, when corrupt
    reason: str = ""
    files: int = 0
    size: int = 0  # bytes listed in the manifest

    @property
    def usable(self) -> bool:
        return self.status != "corrupt"


def verify(ckpt_dir: str | Path, checksums: bool = True) -> Verdict:
    """Check one checkpoint directory against its manifest; the first problem found is reported."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / MANIFEST
    if not ckpt_dir.is_dir():
        return Verdict(ckpt_dir, "corrupt", ckpt_dir, "the directory does not exist")
    if not manifest_path.exists():
        if (ckpt_dir / ".metadata").exists():
            return Verdict(ckpt_dir, "unverified", None, "no manifest.json (saved before manifests existed)")
        return Verdict(ckpt_dir, "corrupt", manifest_path, "missing, and no DCP .metadata either")
    try:
        manifest = json.loads(manifest_path.read_text())
        listed = manifest["files"]
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return Verdict(ckpt_dir, "corrupt", manifest_path, f"unreadable manifest ({e})")
    total = sum(entry["size"] for entry in listed.values())
    for name, entry in listed.items():
        path = ckpt_dir / name
        if not path.is_file():
            return Verdict(ckpt_dir, "corrupt", path, f"missing (the manifest lists {entry['size']} bytes)",
                           len(listed), total)
        size = path.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "grown"
            return Verdict(ckpt_dir, "corrupt", path, f"{what}: {size} bytes, the manifest says {entry['size']}",
                           len(listed), total)
        if checksums and file_digest(path) != entry["sha256"]:
            return Verdict(ckpt_dir, "corrupt", path, "sha256 differs from the manifest (changed bytes)",
                           len(listed), total)
    return Verdict(ckpt_dir, "ok", files=len(listed), size=total)
