"""`seekforge probe dump|compare|report|trace`: thin wrappers over probe/*.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODES = {
    "dump": """run one forward (+ backward) of a model on fixed random tokens and write every selected
module call's inputs/outputs/gradients: --mode statistics (max/min/mean/L2/NaN/Inf per tensor,
JSONL), tensor (+ the tensors, safetensors: needed for cosine and error metrics), md5 (+ a hash
per tensor: bit-exactness). --impl transformers dumps the same checkpoint through transformers,
to compare against with --mapping transformers_deepseek_v3.""",
    "compare": """two dumps (A under test, B reference) call by call: cosine, max abs/rel error, fraction
of elements within 1/1000 and 5/1000; pass/fail; the first diverging module in execution order.
Writes CSV (--csv) and optionally HTML (--html); exits 1 when anything fails.""",
    "report": """the HTML report of two dumps: the module tree coloured by the worst metric below each
node, the first diverging module marked (self-contained, opens offline).""",
    "trace": """ask a running `seekforge pretrain` (with a metrics port: --probe FILE with trace.port) or
`seekforge serve` for a torch.profiler Chrome trace of its next N steps (--url), or write the
trigger file of a pretrain run (--run-dir). Without either: `kill -USR2 PID`.""",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "modes:\n" + "\n".join(f"  {mode}: " + text.replace("\n", "\n    ") for mode, text in MODES.items())
    sub = p.add_subparsers(dest="probe_mode", metavar="MODE", required=True)

    def mode_parser(name, text):
        return sub.add_parser(name, help=text, description=MODES[name],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    d = mode_parser("dump", "dump one forward/backward of a model")
    d.add_argument("--model", default="tiny", help="preset name or HF-format checkpoint directory")
    d.add_argument("--impl", choices=["seekforge", "transformers"], default="seekforge",
                   help="which implementation runs the checkpoint (transformers needs a directory)")
    d.add_argument("--config", help="probe config YAML; its `dump` table replaces the flags below")
    d.add_argument("--mode", default="tensor", choices=["statistics", "tensor", "md5"],
                   help="what each call records: summary statistics, the tensors themselves, or their md5")
    d.add_argument("--modules", nargs="+", default=["*"], help="fnmatch patterns or re:REGEX over module names")
    d.add_argument("--no-backward", action="store_true", help="forward only")
    d.add_argument("--batch-size", type=int, default=2, help="sequences in the dumped batch")
    d.add_argument("--seq-len", type=int, default=32, help="tokens per sequence in the dumped batch")
    d.add_argument("--seed", type=int, default=0, help="the token ids and the loss weights")
    d.add_argument("--out", default="probe_dump", help="dump root (writes OUT/step0/rank0)")

    for name, text in [("compare", "compare two dumps: metrics, pass/fail, first divergence"),
                       ("report", "HTML hierarchy report of two dumps")]:
        c = mode_parser(name, text)
        c.add_argument("dump_a", help="dump under test (a dump directory or a root holding one)")
        c.add_argument("dump_b", help="reference dump")
        c.add_argument("--mapping", help="module-name mapping YAML, or a shipped one: transformers_deepseek_v3")
        c.add_argument("--min-cosine", type=float, default=0.9999,
                       help="a tensor passes when its cosine similarity to the reference is at least this")
        c.add_argument("--atol-ratio", type=float, default=1e-3, help="max |a-b| allowed / max |b|")
        c.add_argument("--html", default="probe_report.html" if name == "report" else None, help="HTML report path")
        if name == "compare":
            c.add_argument("--csv", default="probe_compare.csv", help="CSV of every compared slot")

    t = mode_parser("trace", "ask a running pretrain/serve for a profiler trace of its next steps")
    where = t.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the metrics port of pretrain or the serve address, e.g. http://127.0.0.1:8000")
    where.add_argument("--run-dir", help="a pretrain OUT_DIR: touch its probe/trace_request trigger file")
    t.add_argument("--steps", type=int, default=3, help="how many of the next steps the trace covers")


def run(args) -> None:
    {"dump": run_dump, "compare": run_compare, "report": run_compare, "trace": run_trace}[args.probe_mode](args)


def run_dump(args) -> None:
    import torch

    from seekforge.probe.config import DumpConfig, load_probe_config
    from seekforge.probe.dump import Dumper, dump_dir

    cfg = load_probe_config(args.config).dump if args.config else None
    cfg = cfg or DumpConfig(mode=args.mode, modules=args.modules, out_dir=args.out)
    model = load(args.model, args.impl)
    vocab = model.config.vocab_size if args.impl == "transformers" else model.cfg.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
    weights = torch.randn(args.batch_size, args.seq_len, vocab, generator=gen)  # a loss with O(1) gradients
    with Dumper(model, cfg).step(0):
        out = model(ids)
        logits = out.logits if args.impl == "transformers" else out
        if not args.no_backward:
            (logits.float() * weights).sum().backward()
    print(f"dump ({cfg.mode}): {dump_dir(cfg.out_dir, 0, 0)}")


def load(model: str, impl: str):
    import torch

    if impl == "transformers":
        try:
            import transformers  # the reference implementation: the optional `reference` extra
        except ModuleNotFoundError as e:
            raise ValueError("--impl transformers needs transformers: pip install 'seekforge[reference]'") from e
        if not Path(model).is_dir():
            raise ValueError(f"--impl transformers needs a checkpoint directory, got {model!r}")
        from seekforge.model.hf import open_shard, shard_files

        for file in shard_files(Path(model))[0]:  # a truncated shard: our one-line error, not transformers' traceback
            with open_shard(file):
                pass
        return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    from seekforge.config import PRESETS, preset
    from seekforge.model.hf import load_hf
    from seekforge.model.model import build_model

    if model in PRESETS:
        return build_model(preset(model), seed=0).eval()
    if not Path(model).is_dir():
        raise ValueError(f"--model {model!r} is neither a preset ({sorted(PRESETS)}) nor a directory")
    return load_hf(model).eval()


def run_compare(args) -> None:
    from seekforge.probe.compare import Thresholds, compare_dumps, load_dump, load_mapping, write_csv
    from seekforge.probe.report import write_report

    comparison = compare_dumps(load_dump(args.dump_a), load_dump(args.dump_b), load_mapping(args.mapping),
                               Thresholds(min_cosine=args.min_cosine, atol_ratio=args.atol_ratio))
    print(comparison.summary())
    if getattr(args, "csv", None):
        print(f"csv: {write_csv(comparison, args.csv)}")
    if args.html:
        print(f"html: {write_report(comparison, args.html, f'{args.dump_a} vs {args.dump_b}')}")
    if args.probe_mode == "compare" and not comparison.passed:
        sys.exit(1)


def run_trace(args) -> None:
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: ask for at least one step")
    if args.run_dir:
        trigger = Path(args.run_dir) / "probe" / "trace_request"
        trigger.parent.mkdir(parents=True, exist_ok=True)
        trigger.write_text(f"{args.steps}\n")
        print(f"requested {args.steps} steps via {trigger}; traces appear in {trigger.parent / 'traces'}")
        return
    import httpx

    response = httpx.post(args.url.rstrip("/") + "/debug/trace", params={"steps": args.steps}, timeout=10)
    if response.status_code != 202:
        raise ValueError(f"{args.url} answered {response.status_code}: {response.text.strip()}")
    print(response.text.strip())
