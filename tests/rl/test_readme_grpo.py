"""The README's GRPO snippets run as written one after the other: each is a run of its own (a directory that
holds a run resumes it, with that run's model: the second snippet once resumed the first's 0.83M-parameter
run with another --base, a size-mismatch traceback), and a given --base is one that can answer the built-in
task (pretrain's story model never does: every reward 0, nothing to learn). The own-data example runs as
written: its reward module, its prompts file and its command (on a tiny base, for a step)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

from seekforge.rl.cli import add_arguments, config_from_args

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(language: str) -> list[str]:
    """The GRPO section's code blocks in `language`."""
    section = README.read_text().split("### GRPO post-training", 1)[1].split("\n### ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split(f"```{language}\n")[1:]]


def grpo_commands(block: str) -> list[list[str]]:
    lines = [re.sub(r"\s#.*", "", line).strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("seekforge grpo")]


def test_readme_grpo_snippets_are_runs_of_their_own():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    configs = [config_from_args(parser.parse_args(argv)) for argv in grpo_commands(blocks("bash")[0])]
    assert len(configs) >= 2
    out_dirs = [cfg.out_dir for cfg in configs]
    assert len(set(out_dirs)) == len(out_dirs), out_dirs
    for i, cfg in enumerate(configs):
        if cfg.base:  # a base an earlier snippet made (the built-in arithmetic base), not the story model
            assert any(Path(cfg.base).is_relative_to(earlier) for earlier in out_dirs[:i]), cfg.base


def test_readme_own_data_example_runs_as_written(tmp_path, monkeypatch):
    from seekforge.cli import main
    from seekforge.train.metrics import read_metrics
    from tests.rl.test_user_data import tiny_base

    module = next(block for block in blocks("python") if block.startswith("# my_rewards.py"))
    bash = next(block for block in blocks("bash") if "--data prompts.jsonl" in block)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "my_rewards.py").write_text(module)
    script, command = bash.split("\nseekforge grpo", 1)
    subprocess.run(["bash", "-c", script.replace("python -c", f"{sys.executable} -c", 1)], check=True)
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) > 200
    argv = grpo_commands("seekforge grpo" + command)[0]
    base = argv[argv.index("--base") + 1]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    earlier = [config_from_args(parser.parse_args(a)).out_dir for a in grpo_commands(blocks("bash")[0])]
    assert any(Path(base).is_relative_to(d) for d in earlier) and argv[argv.index("--out-dir") + 1] not in earlier
    tiny_base(tmp_path / base)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    main(["grpo", *argv, "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
          "--set", "eval_prompts=2", "--set", "kv_cache_memory=2MiB"])
    out_dir = argv[argv.index("--out-dir") + 1]
    last = read_metrics(tmp_path / out_dir / "metrics.jsonl")[-1]
    assert {"rewards/exact_match/mean", "rewards/format/mean", "eval_pass@4"} <= set(last)
    del sys.modules["my_rewards"]  # the README's name: no other test's
