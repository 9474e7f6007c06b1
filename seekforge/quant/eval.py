"""`seekforge eval --model DIR`: held-out perplexity and built-in task accuracy for any checkpoint
(bf16/fp32, FP8, compressed-tensors), so every quantization scheme is judged by one command.

Perplexity: exp(mean next-token cross-entropy) over samples of the valid split of --data (the built-in
text corpus by default) — the documents `seekforge pretrain` holds out with its default split and seed.
Accuracy: greedy answers to the built-in arithmetic questions, graded by data.corpora.check_answer."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from seekforge.config import TrainConfig
from seekforge.data.corpora import ArithmeticTask, check_answer
from seekforge.data.dataset import build_datasets
from seekforge.errors import UserError
from seekforge.model.generate import generate


@torch.inference_mode()
def perplexity(model, tokenizer, num_samples: int = 32, seq_len: int = 256, seed: int = 0,
               dataset: str = "builtin:text") -> float:
    if num_samples < 1:
        raise UserError(f"--num-samples {num_samples}: perplexity needs at least 1 sample")
    context = model.cfg.max_position_embeddings
    if not 1 <= seq_len <= context:  # past the context RoPE has no trained positions (and memory runs out)
        raise UserError(f"--seq-len {seq_len}: the model's context is 1 to {context} tokens "
                        f"(max_position_embeddings); pass --seq-len {min(context, 256)} or less")
    _, valid, _ = build_datasets(dataset, tokenizer, seq_len, seed, (0, num_samples, 0), TrainConfig.split)
    total, count = 0.0, 0
    for k in range(num_samples):
        sample = valid[k]
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)[None]  # (1, T)
        labels = torch.as_tensor(sample["labels"], dtype=torch.long)[None]
        logits = model(ids).float()  # (1, T, V)
        total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
        count += labels.numel()
    return math.exp(total / count)


@torch.inference_mode()
def task_accuracy(model, tokenizer, num_questions: int = 50, seed: int = 1234, max_new_tokens: int = 24) -> float:
    task, rng = ArithmeticTask(seed), random.Random(seed)
    correct = 0
    for _ in range(num_questions):
        prompt, answer = task.sample(rng)
        out = generate(model, tokenizer.encode(prompt, add_bos=tokenizer.add_bos_token), max_new_tokens,
                       stop_token_ids=(tokenizer.eos_token_id,))
        correct += check_answer(tokenizer.decode(out), answer)
    return correct / num_questions


def add_arguments(p):
    p.add_argument("--model", required=True, help="checkpoint directory (any format seekforge loads) or preset")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "bfloat16", "float32"], default="float32",
                   help="compute dtype of the unquantized parts")
    p.add_argument("--data", default="builtin:text",
                   help="perplexity data, as pretrain's --data (builtin:text, a Megatron .bin/.idx prefix, a blend): "
                        "the valid split pretrain holds out with its default split and seed")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per perplexity sample")
    p.add_argument("--num-samples", type=int, default=32, help="held-out samples for perplexity")
    p.add_argument("--num-questions", type=int, default=50, help="arithmetic questions for accuracy (0: skip)")


def run(args):
    from seekforge.model.load import model_width
    from seekforge.model.precision import resolve_dtype
    from seekforge.quant.load import load_model

    if args.num_questions < 0:
        raise UserError(f"--num-questions {args.num_questions}: pass 0 to skip accuracy, or more")
    dtype = resolve_dtype(args.dtype, hidden_size=model_width(args.model))[0]
    model, tokenizer = load_model(args.model, dtype)
    ppl = perplexity(model, tokenizer, args.num_samples, args.seq_len, dataset=args.data)
    print(f"perplexity ({args.data} valid, {args.num_samples}×{args.seq_len} tokens): {ppl:.4f}")
    if args.num_questions:
        acc = task_accuracy(model, tokenizer, args.num_questions)
        print(f"arithmetic accuracy ({args.num_questions} questions, greedy): {acc:.3f}")
