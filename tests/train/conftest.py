"""Test fakes: a learnable dataset of token windows and a shuffling loader with exact-resume state,
so trainer tests do not depend on the data pipeline's corpora (tested in tests/data)."""

from __future__ import annotations

import pytest
import torch

from seekforge.config import TrainConfig


class PatternDataset:
    """num_samples windows of a learnable sequence: each token is the previous + 1 (mod vocab), with
    10% random tokens. Item: {"input_ids", "labels"} (T,) LongTensors, labels shifted by one."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
        tokens = (start + torch.arange(seq_len + 1)) % vocab_size  # (N, T+1)
        noise = torch.rand(tokens.shape, generator=gen) < 0.1
        tokens[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=gen)
        self.tokens = tokens

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class StandInLoader:
    """Infinite shuffled batches; state = (epoch, position), so resume continues mid-epoch."""

    def __init__(self, dataset, batch_size: int, seed: int = 0):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.position = 0, 0

    def _order(self):
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=gen)

    def __iter__(self):
        return self

    def __next__(self):
        order = self._order()
        if self.position + self.batch_size > len(order):
            self.epoch, self.position = self.epoch + 1, 0
            order = self._order()
        idx = order[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        items = [self.dataset[i] for i in idx]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


def tiny_train_config(tmp_path, **overrides) -> TrainConfig:
    base = dict(preset="tiny", seq_len=32, micro_batch_size=4, grad_accum=2, steps=8, lr=3e-3, min_lr=3e-4,
                warmup=2, log_interval=0, eval_interval=0, save_interval=0, peak_flops=1e11,
                out_dir=str(tmp_path / "run"), export_hf=False, sample_prompt="")
    base.update(overrides)
    return TrainConfig(**base)


@pytest.fixture
def make_loader():
    def make(cfg: TrainConfig, num_samples: int = 64, seed: int = 0):
        vocab = cfg.model_config().vocab_size
        return StandInLoader(PatternDataset(vocab, cfg.seq_len, num_samples, seed), cfg.micro_batch_size, seed)
    return make
