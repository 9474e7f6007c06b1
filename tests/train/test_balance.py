import torch

from seekforge.config import preset
from seekforge.model.moe import MoE
from seekforge.train.balance import update_expert_bias


def test_bias_moves_by_sign_of_load_error_and_counts_reset():
    moe = MoE(preset("tiny"))  # 8 experts
    moe.tokens_per_expert.copy_(torch.tensor([8.0, 0, 4, 4, 4, 4, 4, 4]))  # mean 4
    imbalance = update_expert_bias([moe], bias_update_speed=0.01)
    assert imbalance.tolist() == [2.0]  # max / mean
    expected = torch.tensor([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(moe.gate.e_score_correction_bias, expected, rtol=0, atol=0)
    assert moe.tokens_per_expert.sum() == 0


@torch.no_grad()
def test_skewed_router_becomes_balanced():
    """Gate rows 0 and 1 point along the inputs' shared direction, so without balancing every token
    picks experts 0 and 1 (top-2 of 8: max/mean = 4). The bias updates alone must undo that."""
    torch.manual_seed(0)
    cfg = preset("tiny", n_group=1, topk_group=1)  # no group limit: any expert can win
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    direction = torch.randn(cfg.hidden_size)
    direction /= direction.norm()
    moe.gate.weight[:2] += 0.5 * direction
    imbalances = []
    for _ in range(60):
        x = torch.randn(16, 32, cfg.hidden_size) * 0.3 + direction  # (B, T, H)
        moe(x)
        imbalances.append(update_expert_bias([moe], bias_update_speed=0.003)[0].item())
    assert imbalances[0] > 3.5  # starts almost fully collapsed onto two experts
    assert max(imbalances[-10:]) < 1.6, [round(v, 2) for v in imbalances]  # sign updates jitter near 1.2
    assert moe.gate.e_score_correction_bias[:2].max() < moe.gate.e_score_correction_bias[2:].min()
