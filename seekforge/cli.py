"""`seekforge <verb>`: one entry point; each verb's arguments and code live with its subsystem.

A verb module provides `add_arguments(parser)` and `run(args)`; it is imported only when its verb
runs, so `seekforge --help` stays fast and a missing optional dependency only affects its verb.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

VERBS = {
    "info": ("seekforge.model.info", "print a model's size (total / activated / MTP parameters)"),
    "generate": ("seekforge.model.generate", "generate text from a checkpoint or preset (single sequence)"),
    "pretrain": ("seekforge.train.cli", "pretrain a model (built-in corpus by default)"),
    "preprocess": ("seekforge.data.preprocess", "tokenize JSONL/text into Megatron .bin/.idx files"),
    "convert": ("seekforge.train.convert", "convert between seekforge checkpoints and HF format"),
    "checkpoint": ("seekforge.train.checkpoint_cli", "verify a run's training checkpoints (sizes, sha256)"),
    "serve": ("seekforge.serve.server", "serve a model behind an OpenAI-compatible HTTP API"),
    "bench": ("seekforge.serve.bench", "benchmark a running server (`seekforge bench serve`)"),
    "plan": ("seekforge.plan.cli", "plan a training job: memory, pipeline schedules, stage balance, layout search"),
    "probe": ("seekforge.probe.cli", "dump, compare and report module activations; trace a running job"),
    "quantize": ("seekforge.quant.cli", "quantize a checkpoint by a recipe (W8A8, W4A16) to compressed-tensors"),
    "eval": ("seekforge.quant.eval", "held-out perplexity and built-in task accuracy of any checkpoint"),
    "grpo": ("seekforge.rl.cli", "GRPO post-training with co-located rollouts (built-in task by default)"),
}


def is_user_error(e: BaseException) -> bool:
    """A UserError, or a ValueError that seekforge's own code raised (STYLE.md: ValueError with the fix
    for bad user input). A ValueError from inside torch or another library is not one: its message
    names no file or fix, so it keeps its traceback."""
    from seekforge.errors import UserError

    if isinstance(e, UserError):
        return True
    if not isinstance(e, ValueError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(__file__).resolve().parent)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="seekforge",
        description="Toolkit for DeepSeek-V3-architecture models. `seekforge VERB --help` for details.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    argv = sys.argv[1:] if argv is None else argv
    for verb, (_, help_text) in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] not in VERBS:
        parser.parse_args(argv or ["--help"])
        return
    module = importlib.import_module(VERBS[argv[0]][0])
    verb_parser = argparse.ArgumentParser(prog=f"seekforge {argv[0]}", description=VERBS[argv[0]][1],
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(verb_parser)
    args = verb_parser.parse_args(argv[1:])
    try:
        module.run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line (and how to go on, where the verb says), not a traceback
        hint = module.on_interrupt(args) if hasattr(module, "on_interrupt") else ""
        print(f"\nseekforge {argv[0]}: interrupted{'; ' + hint if hint else ''}", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:
        if not is_user_error(e):
            raise  # a bug (or a library failure nobody translated): the traceback is what helps
        import torch.distributed as dist  # already loaded by any verb that runs distributed

        # Under torchrun every rank fails alike; one message is enough.
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"seekforge {argv[0]}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
