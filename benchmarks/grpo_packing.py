"""GRPO training phase: dynamic packing vs padded micro-batches, on one mixed-length rollout batch.

The batch: 8 prompts × G = 8 completions, prompts of 12–30 tokens, completion lengths long-tailed
(most answers short, a few run to 256 tokens) — what a reasoning-task rollout looks like. Both sides
run the same model and the same GRPO loss (rl/update.py's weights, dapo, fp32) and do forward +
backward over the whole batch:

  padded  TRL's layout: micro-batches of 8 sequences, each padded to its longest member (padding as
          its own attention segment, excluded from the loss);
  packed  rl/packing: rows of ≤ max_pack_tokens tokens, no padding, block-diagonal attention.

Both gradients are checked equal (relative 1e-5) before timing. Median of --repeats runs each,
alternated in the same process.

    PYTHONPATH=. python benchmarks/grpo_packing.py [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from seekforge.config import preset
from seekforge.model.model import build_model
from seekforge.rl.algorithm import group_advantages, policy_loss, sequence_weights, token_log_probs, token_share
from seekforge.rl.packing import pack_sequences
from seekforge.rl.update import LossSettings, TrainingBatch, accumulate_gradients

PROMPTS, G, MAX_NEW = 8, 8, 256
SETTINGS = LossSettings("dapo")


def mixed_batch(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, completions = [], []
    for _ in range(PROMPTS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(12, 30))]
        for _ in range(G):
            n = min(MAX_NEW, int(rng.expovariate(1 / 40)) + 2)  # mean ~40, a tail to the limit
            prompts.append(prompt)
            completions.append([rng.randrange(vocab) for _ in range(n)])
    rewards = torch.tensor([rng.random() for _ in completions])
    lengths = [len(c) for c in completions]
    weights = sequence_weights(SETTINGS.loss_type, torch.tensor(lengths), MAX_NEW)
    return prompts, completions, TrainingBatch(lengths, group_advantages(rewards, G), None, None, weights,
                                               token_share(torch.tensor(lengths)))


def padded_step(model, prompts, completions, batch, micro_batch: int = 8):
    """Forward + backward in padded micro-batches (padding gets its own segment id and no loss)."""
    for start in range(0, len(completions), micro_batch):
        idx = range(start, min(start + micro_batch, len(completions)))
        seqs = [prompts[i] + completions[i] for i in idx]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        segments = torch.ones(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s)
            segments[r, :len(s)] = 0
        positions = torch.arange(width).expand(len(seqs), width)
        h, _, _ = model.hidden(ids, positions, segments)
        logits = model.lm_head(model.norm(h[:, :-1]))  # (B, width-1, V), position p predicts p + 1
        targets = ids[:, 1:]
        mask = torch.zeros(len(seqs), width - 1)
        advantages, weights = torch.zeros(len(seqs), 1), torch.zeros(len(seqs), 1)
        for r, i in enumerate(idx):
            mask[r, len(prompts[i]) - 1:len(prompts[i]) - 1 + len(completions[i])] = 1
            advantages[r], weights[r] = batch.advantages[i], batch.weights[i]
        logp, _ = token_log_probs(logits, targets)
        loss, _ = policy_loss(logp, logp.detach(), advantages, weights * mask, SETTINGS)
        loss.backward()


def packed_step(model, prompts, completions, batch, max_pack_tokens: int = 1024):
    rows = pack_sequences(prompts, completions, max_pack_tokens, max_pack_count=64)
    accumulate_gradients(model, rows, batch, SETTINGS)


def gradient(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = preset("small", num_nextn_predict_layers=0, max_position_embeddings=512)
    model = build_model(cfg, seed=0)
    prompts, completions, batch = mixed_batch(cfg.vocab_size)
    real = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    padded_tokens = sum(max(len(prompts[i]) + len(completions[i]) for i in range(s, s + 8)) * 8
                        for s in range(0, len(completions), 8))
    rows = pack_sequences(prompts, completions, 1024, 64)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, fp32; "
          f"model: small preset ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, no MTP)")
    print(f"batch: {len(completions)} sequences, {real} tokens; padded micro-batches of 8 hold {padded_tokens} "
          f"tokens; packing: {len(rows)} rows of <= 1024 tokens hold {sum(r.input_ids.numel() for r in rows)}")

    grads = {}
    for name, fn in (("padded", padded_step), ("packed", packed_step)):
        model.zero_grad(set_to_none=True)
        fn(model, prompts, completions, batch)
        grads[name] = gradient(model)
    rel = ((grads["packed"] - grads["padded"]).norm() / grads["padded"].norm()).item()
    assert rel <= 1e-5, f"packed and padded gradients differ: {rel:.2e}"
    print(f"gradients equal: relative difference {rel:.1e}")

    times = {"padded": [], "packed": []}
    for _ in range(args.repeats):
        for name, fn in (("padded", padded_step), ("packed", packed_step)):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn(model, prompts, completions, batch)
            times[name].append(time.perf_counter() - start)
    padded, packed = statistics.median(times["padded"]), statistics.median(times["packed"])
    print(f"training phase (forward + backward), median of {args.repeats}: padded (TRL layout) {padded:.2f}s, "
          f"packed (seekforge) {packed:.2f}s → {padded / packed:.2f}x, {100 * (1 - packed / padded):.0f}% less time")


if __name__ == "__main__":
    main()
