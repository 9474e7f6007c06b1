"""`seekforge convert`: training checkpoints ⇄ Hugging Face directories.

    DCP → HF   a step_* directory (or a run directory / its checkpoints/, meaning `latest`) becomes
               an HF `DeepseekV3ForCausalLM` directory (config.json + safetensors) via model/hf.py, with
               the run's tokenizer (train_config.yaml) saved beside it.
    HF → DCP   an HF directory becomes a weights-only DCP checkpoint `OUT/checkpoints/step_000000`;
               `seekforge pretrain --out-dir OUT` then continues training from those weights with a
               fresh optimizer (the model config is taken from the checkpoint).
The direction follows from the source: an HF directory has config.json and *.safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from seekforge.config import ModelConfig


def resolve_checkpoint(source: str | Path) -> Path:
    """A step_* dir, a checkpoints/ dir, or a run dir → the DCP checkpoint directory, checked against its
    manifest (a damaged step_* directory raises CorruptFileError; a run falls back as a resume does)."""
    from seekforge.errors import CorruptFileError
    from seekforge.train import integrity
    from seekforge.train.checkpoint import latest_checkpoint, step_dirs

    source = Path(source)
    if (source / ".metadata").exists() or (source / integrity.MANIFEST).exists():
        verdict = integrity.verify(source)
        if not verdict.usable:
            raise CorruptFileError(verdict.file, verdict.reason, f"checkpoint {source.name} is damaged; convert an "
                                   f"intact one (`seekforge checkpoint verify {source.parent.parent}` lists them)")
        return source
    for root in (source, source / "checkpoints"):
        if (root / "latest").exists() or (root.is_dir() and step_dirs(root)):
            try:
                return latest_checkpoint(root)
            except CorruptFileError as e:  # its fix names pretrain's flags
                raise CorruptFileError(e.path, e.reason, f"no intact checkpoint to convert under {root}") from None
    raise ValueError(f"{source} holds no DCP checkpoint: pass a step_* directory, a checkpoints/ "
                     "directory with a `latest` file, or a run directory")


def dcp_to_hf(source: str | Path, hf_dir: str | Path, dtype: torch.dtype = torch.float32,
              max_shard_size: str = "5GB") -> Path:
    """Export a checkpoint as pretrain exports its hf/: by default in fp32, the master weights' dtype
    training checkpoints hold (bf16 halves the files and rounds the weights)."""
    from seekforge.model.hf import save_hf
    from seekforge.model.model import build_model
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.train.checkpoint import load_checkpoint

    ckpt = resolve_checkpoint(source)
    if not (ckpt / "config.json").exists():
        raise ValueError(f"{ckpt} has no config.json (saved by an older seekforge?); cannot rebuild the model")
    model = build_model(ModelConfig.from_hf(ckpt), "cpu", torch.float32)
    load_checkpoint(ckpt, model, restore_rng=False)
    save_hf(model, hf_dir, max_shard_size, dtype=dtype)
    run_config = ckpt.parent.parent / "train_config.yaml"  # RUN/checkpoints/step_N: the run's tokenizer
    if run_config.exists():
        tokenizer = yaml.safe_load(run_config.read_text()).get("tokenizer", "byte")
        load_tokenizer(tokenizer).save(hf_dir)
    return Path(hf_dir)


def hf_to_dcp(hf_dir: str | Path, out_dir: str | Path) -> Path:
    from seekforge.model.hf import load_hf
    from seekforge.train.checkpoint import save_checkpoint, step_dirs

    out_dir = Path(out_dir)
    if _is_hf_dir(out_dir):
        raise ValueError(f"{out_dir} is an HF directory; from an HF source, DEST is a run directory to write "
                         "checkpoints/step_000000 into: pass a new directory")
    existing = step_dirs(out_dir / "checkpoints") if (out_dir / "checkpoints").is_dir() else []
    if existing:  # the save below keeps one checkpoint: it would delete a run's own
        raise ValueError(f"{out_dir} already holds training checkpoints ({', '.join(p.name for p in existing[:3])}"
                         f"{', …' if len(existing) > 3 else ''}), which this conversion would replace; pass a new "
                         "run directory")
    model = load_hf(hf_dir, device="cpu", dtype=torch.float32)  # training keeps fp32 master weights
    return save_checkpoint(out_dir / "checkpoints", 0, model, optimizer=None, keep=1)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def add_arguments(p) -> None:
    p.description = __doc__.split("\n\n")[0] + " The direction follows from SOURCE."
    p.add_argument("source", help="a training checkpoint (step_* / checkpoints/ / run dir) or an HF directory")
    p.add_argument("dest", help="HF output directory (from DCP), or a run directory (from HF)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weight dtype of the HF export (DCP → HF only): float32 keeps the checkpoint's master "
                        "weights as pretrain's hf/ export does; bfloat16 halves the files")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file (DCP → HF only); a model larger than this is written as "
                        "model-0000i-of-0000n.safetensors shards with model.safetensors.index.json, as HF does")


def run(args) -> None:
    source = Path(args.source)
    if not source.exists():
        raise ValueError(f"{source} does not exist")
    if _is_hf_dir(source):
        path = hf_to_dcp(source, args.dest)
        print(f"wrote {path}; continue training with: seekforge pretrain --out-dir {args.dest}")
    else:
        path = dcp_to_hf(source, args.dest, getattr(torch, args.dtype), args.max_shard_size)
        print(f"wrote HF checkpoint {path}")
