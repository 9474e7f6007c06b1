"""`seekforge <verb>`: one entry point; each verb's arguments and code live with its subsystem.

A verb module provides `add_arguments(parser)` and `run(args)` (and may provide `on_interrupt(args)`: what
Ctrl-C should tell the user). `verb_module` imports it only when its verb runs, so `seekforge --help` stays
fast and a missing optional dependency only affects its verb. The imports are plain import statements, so
a reader, and import-linter's layer contract, see which module serves which verb (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import ModuleType

VERBS = {
    "info": "print a model's size (total / activated / MTP parameters)",
    "generate": "generate text from a checkpoint or preset (single sequence)",
    "pretrain": "pretrain a model (built-in corpus by default)",
    "preprocess": "tokenize JSONL/text into Megatron .bin/.idx files",
    "convert": "convert between seekforge checkpoints and HF format",
    "checkpoint": "verify a run's training checkpoints (sizes, sha256)",
    "serve": "serve a model behind an OpenAI-compatible HTTP API",
    "bench": "benchmark a running server (`seekforge bench serve`)",
    "plan": "plan a training job: memory, pipeline schedules, stage balance, layout search",
    "probe": "dump, compare and report module activations; trace a running job",
    "quantize": "quantize a checkpoint by a recipe (W8A8, W4A16) to compressed-tensors",
    "eval": "held-out perplexity and built-in task accuracy of any checkpoint",
    "grpo": "GRPO post-training with co-located rollouts (built-in task by default)",
}

# The verbs that run a model on this machine's cores: they choose OpenMP's wait policy at start (model/threads.py).
COMPUTE_VERBS = {"generate", "pretrain", "serve", "quantize", "eval", "grpo", "probe"}


def verb_module(verb: str) -> ModuleType:
    """The module that serves `verb` (a key of VERBS)."""
    match verb:
        case "info":
            from seekforge.model import info as module
        case "generate":
            from seekforge.model import generate as module
        case "pretrain":
            from seekforge.train import cli as module
        case "preprocess":
            from seekforge.data import preprocess as module
        case "convert":
            from seekforge.train import convert as module
        case "checkpoint":
            from seekforge.train import checkpoint_cli as module
        case "serve":
            from seekforge.serve import cli as module
        case "bench":
            from seekforge.serve import bench as module
        case "plan":
            from seekforge.plan import cli as module
        case "probe":
            from seekforge.probe import cli as module
        case "quantize":
            from seekforge.quant import cli as module
        case "eval":
            from seekforge.quant import eval as module
        case "grpo":
            from seekforge.rl import cli as module
        case _:
            raise KeyError(f"no verb {verb!r}; the verbs are {', '.join(VERBS)}")
    return module


def is_user_error(e: BaseException) -> bool:
    """A UserError, or a ValueError that seekforge's own code raised (docs/STYLE.md: ValueError with the fix
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
    for verb, help_text in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] not in VERBS:
        parser.parse_args(argv or ["--help"])
        return
    openmp_policy = "OpenMP wait policy: the runtime's default"
    if argv[0] in COMPUTE_VERBS and not {"-h", "--help"} & set(argv[1:]):
        # Before the verb imports torch: OpenMP reads its wait policy once, when torch loads it (model/threads.py).
        from seekforge.model.threads import configure_openmp

        openmp_policy = configure_openmp()
    module = verb_module(argv[0])
    verb_parser = argparse.ArgumentParser(prog=f"seekforge {argv[0]}", description=VERBS[argv[0]],
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(verb_parser)
    args = verb_parser.parse_args(argv[1:])
    args.openmp_policy = openmp_policy  # for the verb's log
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
