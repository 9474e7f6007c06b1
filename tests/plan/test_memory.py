"""The memory dry run: measured against live tensor bytes of a real training step on one process
(fast), on gloo ranks (slow, benchmarks/plan_memory.py), and its sharding arithmetic."""

import sys
from pathlib import Path

import pytest
import torch

from seekforge.config import ParallelConfig, TrainConfig, preset
from seekforge.model.model import build_model
from seekforge.model.precision import resolve_dtype
from seekforge.plan.measure import LiveBytes, ProfilerLiveBytes, state_tensors
from seekforge.plan.memory import cp_attention_bytes, estimate_memory, expected_nodes_per_token
from seekforge.plan.traced import traced_peak
from seekforge.train.trainer import Trainer, prepare_model

TOLERANCE = 0.10  # the bar: predicted peak within 10% of the measured one

ROOT = Path(__file__).resolve().parents[2]


def measured_peak(cfg: TrainConfig) -> int:
    model = prepare_model(build_model(cfg.model_config(), seed=0), cfg)
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, cfg.model_config().vocab_size, (cfg.micro_batch_size, cfg.seq_len + 1),
                                   generator=gen)
            yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    trainer = Trainer(cfg, model, batches(), out_dir="/tmp/unused")
    trainer.train_step()  # creates the AdamW states
    tracker = LiveBytes(state_tensors(trainer.modules, trainer.optimizers, trainer.master_weights))
    with tracker:
        trainer.train_step()
    return tracker.peak


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_single_device_peak_within_ten_percent(recompute):
    torch.set_num_threads(1)
    cfg = TrainConfig(preset="small", model=dict(num_hidden_layers=2), seq_len=128, micro_batch_size=2,
                      recompute=recompute, peak_flops=1.0, eval_interval=0)
    # the dtype the Trainer's 'auto' runs on this CPU: bf16 where it has native bf16 matmuls, fp32 on AVX2
    dtype = "bf16" if resolve_dtype(cfg.dtype, "cpu", cfg.model_config().hidden_size)[0] == torch.bfloat16 else "fp32"
    plan = estimate_memory(cfg.model_config(), ParallelConfig(), cfg.micro_batch_size, cfg.seq_len, dtype,
                           recompute=recompute)
    measured = measured_peak(cfg)
    assert plan.peak == pytest.approx(measured, rel=TOLERANCE)
    if recompute == "none":  # the traced mode runs the same step on fake tensors
        traced = traced_peak(cfg.model_config(), cfg.micro_batch_size, cfg.seq_len, dtype, recompute)
        assert traced == pytest.approx(measured, rel=TOLERANCE)


def test_live_bytes_counts_storages_once_and_frees():
    with LiveBytes() as m:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:]  # same storage
        b = a * 2
        del b
        c = torch.ones(10)
    assert m.peak == 8000 and m.live == 4040
    del view, c


def test_fsdp_shards_state_but_not_activations():
    cfg = preset("small")
    one = estimate_memory(cfg, ParallelConfig(), 4, 256).ranks[0]
    four = estimate_memory(cfg, ParallelConfig(dp_shard=4), 4, 256).ranks[0]
    assert four.params == pytest.approx(one.params / 4)
    assert four.optimizer == pytest.approx(one.optimizer / 4)
    assert four.activations == pytest.approx(one.activations)
    bf16_states = estimate_memory(cfg, ParallelConfig(dp_shard=4), 4, 256, optimizer_bytes=2).ranks[0]
    assert bf16_states.optimizer == pytest.approx(four.optimizer / 2)


def test_pipeline_first_rank_holds_more_micro_batches_under_1f1b():
    cfg = preset("small", num_hidden_layers=8, num_nextn_predict_layers=0, first_k_dense_replace=0)
    plan = estimate_memory(cfg, ParallelConfig(pp=4, microbatches=8), 8, 256, "fp32")
    acts = [r.activations for r in plan.ranks]
    assert acts[0] > acts[1] > acts[2] > acts[3] * 0.99  # 4, 3, 2, 1 in flight (the last holds the head)


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="bf16"):
        estimate_memory(preset("tiny"), ParallelConfig(), 1, 16, dtype="fp16")
    with pytest.raises(ValueError, match="divisible"):
        estimate_memory(preset("tiny"), ParallelConfig(pp=2, microbatches=4), 6, 16)


def test_traced_mode_shards_under_fsdp_and_refuses_what_it_cannot_fake():
    cfg = preset("small", num_hidden_layers=2)
    for pc in (None, ParallelConfig(dp_shard=4)):  # the traced step agrees with the analytic estimate
        traced = traced_peak(cfg, 2, 64, pc=pc)  # its fake collectives end at once: none in flight
        plan = estimate_memory(cfg, pc or ParallelConfig(), 2, 64, collectives_in_flight=False)
        assert traced == pytest.approx(plan.peak, rel=TOLERANCE)
    for pc in (ParallelConfig(dp_shard=2, ep=2), ParallelConfig(cp=2)):
        with pytest.raises(ValueError, match="analytic"):
            traced_peak(cfg, 2, 64, pc=pc)


def test_profiler_reference_sees_what_no_operator_returns():
    """The allocation record counts a storage made outside the dispatch window (before LiveBytes is
    entered, never passed in); LiveBytes agrees once it is passed in as existing state."""
    with ProfilerLiveBytes() as ref:
        outside = torch.ones(2000)  # 8000 bytes, made before the window
        with ref.window(), LiveBytes() as blind:
            a = torch.ones(1000)
            del a
        with LiveBytes([outside]) as told:
            b = torch.ones(1000)
            del b
    assert ref.peak >= 12000
    assert blind.peak == 4000 and told.peak == 12000


def test_master_weights_state_and_per_ep_rank_rows():
    cfg = preset("small", num_hidden_layers=2)
    bf16 = estimate_memory(cfg, ParallelConfig(), 2, 64, "bf16").ranks[0]
    fp32 = estimate_memory(cfg, ParallelConfig(), 2, 64, "fp32").ranks[0]
    assert bf16.copies > 0 and fp32.copies == 0  # train/master.py's persistent bf16 weights
    # bf16's optimizer step holds the main gradients and the copies beside params + AdamW: 1.5× fp32's grads
    assert bf16.peak > fp32.params * 4 * 0.99
    pc = ParallelConfig(dp_shard=2, ep=2)
    even = estimate_memory(cfg, pc, 2, 64, moe_skew=1.0)
    uneven = estimate_memory(cfg, pc, 2, 64, moe_skew=[1.5, 0.5])
    assert uneven.rank_peak(0) > even.rank_peak(0) > uneven.rank_peak(1)
    assert "EP rank 1" in uneven.rank_of(1).name
    with pytest.raises(ValueError, match="one per EP rank"):
        estimate_memory(cfg, pc, 2, 64, moe_skew=[1.0, 1.0, 1.0])


def test_context_parallel_divides_activations_and_shards_with_fsdp():
    cfg = preset("small", num_hidden_layers=2)
    one = estimate_memory(cfg, ParallelConfig(), 2, 512, "fp32").ranks[0]
    cp2 = estimate_memory(cfg, ParallelConfig(cp=2), 2, 512, "fp32").ranks[0]
    assert cp2.params == one.params  # cp alone replicates the weights (gradients all-reduced over cp)
    # T/cp tokens per rank, and ring attention saves no scores (one device's (T, T) probabilities): below half
    assert 0.25 * one.activations < cp2.activations < 0.5 * one.activations
    with_fsdp = estimate_memory(cfg, ParallelConfig(cp=2, dp_shard=2), 2, 512, "fp32").ranks[0]
    assert with_fsdp.params == pytest.approx(one.params / 4)  # FSDP shards over dp_shard × cp
    nh, local = cfg.num_attention_heads, 2 * 256
    saved, workspace = cp_attention_bytes(cfg, 2, 512, 2, nh, 4)
    # q, the output, this rank's latents and an fp32 LSE per row and head: linear in T/cp
    assert saved == 4.0 * local * (nh * (cfg.qk_head_dim + cfg.v_head_dim) + cfg.kv_lora_rank
                                   + cfg.qk_rope_head_dim + nh)
    assert cp_attention_bytes(cfg, 2, 1024, 4, nh, 4) == (saved, workspace)  # the same tokens per rank
    # a few fp32 (T/2cp, T/2cp) tiles at a time, never a (T/cp, T) score matrix: far below one at long rows
    assert cp_attention_bytes(cfg, 1, 16384, 4, nh, 2)[1] < 0.25 * 4.0 * nh * 4096 * 16384
    # bf16 on cp ranks that replicate plain weights: the Trainer's master weights, as on one process
    from seekforge.plan.memory import UnitBytes

    assert UnitBytes(cfg, ParallelConfig(cp=2), 2, 512, 2, 1.0).master
    assert not UnitBytes(cfg, ParallelConfig(cp=2, tp=2), 2, 512, 2, 1.0).master  # DTensor weights: autocast
    with pytest.raises(ValueError, match="multiple of 4"):
        estimate_memory(cfg, ParallelConfig(cp=2), 2, 510)


def test_expert_tp_gathers_rows_and_shards_weights():
    from seekforge.plan.memory import UnitBytes
    from seekforge.plan.shapes import model_units

    cfg = preset("small", num_hidden_layers=2)
    ep = estimate_memory(cfg, ParallelConfig(dp_shard=4, ep=2), 2, 256).ranks[0]
    etp = estimate_memory(cfg, ParallelConfig(dp_shard=4, ep=2, etp=2), 2, 256).ranks[0]
    assert ep.params == etp.params  # E/ep experts, 1/etp of each, over dp_shard / (ep·etp) ranks: 1/dp_shard
    assert etp.activations > ep.activations  # the etp ranks' copies gathered at the experts
    assert etp.copies < ep.copies  # bf16 copies of 1/etp of the experts
    moe = next(u for u in model_units(cfg) if u.expert_params)
    shape = UnitBytes(cfg, ParallelConfig(dp_shard=4, ep=2, etp=2), 2, 256, 2, 1.0)
    rows = 2 * 256 * cfg.num_experts_per_tok * 2  # the etp ranks' copies
    assert shape._etp_exchange(moe) == 3 * 2 * rows * 2 * cfg.moe_intermediate_size / 2  # the gate/up exchange


def test_hierarchical_ep_keeps_a_slot_row_per_token_and_node():
    cfg = preset("small", num_hidden_layers=2)  # 16 experts top-4 in 4 groups, topk_group 2
    assert expected_nodes_per_token(cfg, 1) == 1.0
    assert 1 < expected_nodes_per_token(cfg, 2) <= 2  # node-limited: 2 groups, so at most 2 nodes
    flat = estimate_memory(cfg, ParallelConfig(dp_shard=4, ep=4), 2, 256).ranks[0]
    nodes = estimate_memory(cfg, ParallelConfig(dp_shard=4, ep=4, ep_nodes=2), 2, 256).ranks[0]
    # (token, node) rows of K slots each: more than the K copies per token the flat combine weights
    assert nodes.activations > flat.activations


@pytest.mark.slow
def test_measured_table_on_gloo_ranks():
    """benchmarks/plan_memory.py's cases (single device bf16/fp32 and every recompute mode, a config
    without q_lora, FSDP, EP, two pipeline schedules, cp, cp × FSDP, cp in bf16, etp × ep, hierarchical EP) against
    the profiler's allocation record; gloo cases as the median of 3 runs (gloo's in-flight copies under
    FSDP follow the machine's load)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_memory

    for case in plan_memory.CASES:
        plan = plan_memory.predict(case)
        for rank, measured in enumerate(plan_memory.measure(case, repeats=3)):
            assert plan.rank_peak(rank) == pytest.approx(measured["profiler"], rel=TOLERANCE), (case.name, rank)
