"""`seekforge quantize --model DIR --recipe recipe.yaml | --scheme NAME --out DIR`.

Everything a recipe can get wrong (scheme, module patterns, group size, calibration data) is checked
before the first weight changes; the result is a compressed-tensors checkpoint that `seekforge serve`,
`seekforge eval` and the engine load like any other."""

from __future__ import annotations

import argparse
from pathlib import Path

from seekforge.quant.schemes import SCHEMES


def add_arguments(p):
    p.add_argument("--model", required=True, help="HF checkpoint directory (or a preset name, for trying it out)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--recipe", help="YAML recipe (keys: seekforge/quant/recipe.py Recipe)")
    how.add_argument("--scheme", choices=list(SCHEMES), help="a scheme with the default recipe around it")
    p.add_argument("--method", choices=["rtn", "gptq", "awq"], default="rtn",
                   help="with --scheme: weight rounding (awq: activation-aware scales, then RTN)")
    p.add_argument("--group-size", type=int, default=argparse.SUPPRESS,
                   help="with --scheme w4a16*: input columns per weight scale (default: 128)")
    p.add_argument("--num-samples", type=int, default=argparse.SUPPRESS,
                   help="calibration samples (default: the recipe's, 64)")
    p.add_argument("--dataset", default=None, help="calibration data: builtin:text or a JSONL file of {\"text\": …}")
    p.add_argument("--out", required=True, help="output checkpoint directory")


def recipe_from_args(args):
    from seekforge.quant.recipe import Recipe

    if args.recipe:
        recipe = Recipe.from_file(args.recipe)
    else:
        recipe = Recipe(scheme=args.scheme, method=args.method, group_size=getattr(args, "group_size", None))
    if getattr(args, "num_samples", None) is not None:
        recipe.num_calibration_samples = args.num_samples
    if args.dataset is not None:
        recipe.dataset = args.dataset
    recipe.__post_init__()  # the overrides go through the same checks
    return recipe


def check_out(out: Path, model: Path) -> None:
    """ValueError where writing `out` would replace a checkpoint that is not a quantized one (the model's own, or
    another by a slip of the hand): the output replaces its directory whole."""
    config = out / "config.json"
    same = out.exists() and out.resolve() == model.resolve()
    if same or config.exists() and "quantization_config" not in config.read_text(errors="replace"):
        raise ValueError(f"--out {out} holds a checkpoint that is not quantized{' (the --model one)' if same else ''}, "
                         "which the output would replace; give another --out directory")


def run(args):
    from seekforge.model.load import load_model
    from seekforge.quant.calibrate import quantize_model
    from seekforge.quant.checkpoint import save_compressed
    from seekforge.quant.data import calibration_samples
    from seekforge.quant.recipe import resolve

    recipe = recipe_from_args(args)
    check_out(Path(args.out), Path(args.model))
    model, tokenizer = load_model(args.model)  # fp32: calibration statistics and GPTQ in full precision
    resolve(model, recipe)  # patterns and group sizes, before anything else
    samples = None
    if recipe.needs_calibration:
        samples = calibration_samples(recipe.dataset, tokenizer, model.cfg.vocab_size, recipe.num_calibration_samples,
                                      recipe.max_seq_length, recipe.seed)
    report = quantize_model(model, recipe, samples)
    print(report.summary())
    source = Path(args.model)
    save_compressed(model, args.out, tokenizer_dir=source if source.is_dir() else None)
    print(f"compressed-tensors checkpoint: {args.out} (serve it: seekforge serve --model {args.out})")
