"""The README's GRPO snippets run as written one after the other: each is a run of its own (a directory that
holds a run resumes it, with that run's model: the second snippet once resumed the first's 0.83M-parameter
run with another --base, a size-mismatch traceback), and a given --base is one that can answer the built-in
task (pretrain's story model never does: every reward 0, nothing to learn)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from seekforge.rl.cli import add_arguments, config_from_args

README = Path(__file__).resolve().parents[2] / "README.md"


def grpo_commands() -> list[list[str]]:
    section = README.read_text().split("### GRPO post-training", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [re.sub(r"\s#.*", "", line).strip() for line in block.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("seekforge grpo")]


def test_readme_grpo_snippets_are_runs_of_their_own():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    configs = [config_from_args(parser.parse_args(argv)) for argv in grpo_commands()]
    assert len(configs) >= 2
    out_dirs = [cfg.out_dir for cfg in configs]
    assert len(set(out_dirs)) == len(out_dirs), out_dirs
    for i, cfg in enumerate(configs):
        if cfg.base:  # a base an earlier snippet made (the built-in arithmetic base), not the story model
            assert any(Path(cfg.base).is_relative_to(earlier) for earlier in out_dirs[:i]), cfg.base
