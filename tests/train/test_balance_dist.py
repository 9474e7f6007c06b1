"""The bias update uses the global expert load: two gloo ranks with different local loads must
apply the same update, equal to the single-process update on the summed counts."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seekforge.config import preset
from seekforge.model.moe import MoE
from seekforge.train.balance import update_expert_bias

LOCAL_COUNTS = [[6.0, 0, 1, 1, 0, 0, 0, 0], [0.0, 0, 1, 1, 2, 2, 2, 0]]  # sum: [6,0,2,2,2,2,2,0], mean 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        moe = MoE(preset("tiny"))
        moe.tokens_per_expert.copy_(torch.tensor(LOCAL_COUNTS[rank]))
        imbalance = update_expert_bias([moe], bias_update_speed=0.1).tolist()
        results[rank] = (imbalance, moe.gate.e_score_correction_bias.tolist())
    finally:
        dist.destroy_process_group()


def test_update_uses_global_counts_across_ranks():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=2, join=True)
    single = MoE(preset("tiny"))
    single.tokens_per_expert.copy_(torch.tensor(LOCAL_COUNTS).sum(0))
    expected_imbalance = update_expert_bias([single], bias_update_speed=0.1).tolist()
    expected_bias = single.gate.e_score_correction_bias.tolist()
    assert expected_imbalance == [3.0]
    for rank in (0, 1):
        assert results[rank] == (expected_imbalance, expected_bias)
