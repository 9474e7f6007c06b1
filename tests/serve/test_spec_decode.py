"""MTP speculative decoding: greedy outputs equal the plain engine's (batching, chunked prefill, prefix
cache hits, preemption, with drafts that are partly right so accepts and rollbacks both happen), and
sampled outputs follow the target model's distribution (the pure rejection rule on fake
distributions, and the whole engine on a small-vocabulary model, by chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from seekforge.config import preset
from seekforge.model.generate import generate
from seekforge.model.model import build_model
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams
from seekforge.serve.spec_decode import SpecDecoder, rejection_sample

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 64, 9)]
    return out + [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 20)]


@pytest.fixture(scope="module")
def model():
    """Norms away from 1 (a random init has them at exactly 1, where an extra norm goes unseen)."""
    from tests.model.test_hf import randomize_

    return randomize_(build_model(preset("tiny"), seed=0)).eval()


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [generate(model, p, MAX_NEW) for p in prompts]


@pytest.fixture
def oracle_drafts(monkeypatch, prompts, reference):
    """Replace the MTP drafts with the reference continuation, every third draft wrong: a random
    tiny model's own MTP module almost never agrees with it, so this makes accepts happen."""
    continuation = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}

    def draw(self, seqs, logits):
        for seq in seqs:
            ref = continuation[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            i = seq.num_output_tokens + len(seq.draft_token_ids)
            token = ref[i] if i < len(ref) else 0
            seq.draft_token_ids.append((token + 1) % 256 if i % 3 == 2 else token)

    monkeypatch.setattr(SpecDecoder, "_draw", draw)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_equals_plain_engine(model, byte_tokenizer, prompts, reference, oracle_drafts, k, chunked):
    llm = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=128, speculative_tokens=k,
              enable_chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else 256)
    for _ in range(2):  # the second round hits the prefix cache: hashes must cover accepted tokens only
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 8 * 8 for p in prompts]
    spec = llm.engine.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both paths ran
    assert spec.mean_accepted_length > 1
    assert llm.engine.block_manager.num_free_blocks == 128


def test_greedy_equals_plain_engine_own_mtp_under_preemption(model, byte_tokenizer, prompts, reference):
    llm = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=24, max_num_batched_tokens=64,
              speculative_tokens=2)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and 0 <= stats["spec_acceptance_rate"] <= 1


def test_stop_inside_accepted_drafts_discards_the_rest(model, byte_tokenizer, prompts, reference, oracle_drafts):
    # stop on the reference's 5th token: drafts accepted past it must not reach the output
    outs = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=128, speculative_tokens=3).generate(
        prompts[:4], [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[r[4]]) for r in reference[:4]])
    for out, ref in zip(outs, reference[:4], strict=True):
        assert out.outputs[0].token_ids == ref[:ref.index(ref[4]) + 1]
        assert out.outputs[0].finish_reason == "stop"


def test_mtp_needed(byte_tokenizer):
    model = build_model(preset("tiny", num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        LLM(model, byte_tokenizer, num_kv_blocks=8, speculative_tokens=2)


# ---------------------------------------------------------------------------------------- sampling
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    observed, probs = counts.double(), probs.double()
    return chisquare(observed.numpy(), (probs / probs.sum() * observed.sum()).numpy()).pvalue


def test_rejection_sample_matches_target_distribution():
    """Fixed fake target/draft distributions (V = 5, K = 3): the first emitted token follows p_0, and
    where one draft was accepted the second follows p_1, whatever q is."""
    g = torch.Generator().manual_seed(0)
    n, k, v = 200_000, 3, 5
    p = torch.rand(k + 1, v, generator=g) ** 3
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(k, v, generator=g)
    q[1, 2] = 0  # q may miss tokens p has (then only the residual can produce them)
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    num_accepted, final = rejection_sample(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts,
                                           torch.full((n,), k), torch.rand(n, k, generator=g),
                                           torch.empty(n, v).exponential_(generator=g))
    first = torch.where(num_accepted > 0, drafts[:, 0], final)
    assert chi2_pvalue(torch.bincount(first, minlength=v), p[0]) > 1e-3
    ok = num_accepted > 0
    second = torch.where(num_accepted[ok] > 1, drafts[ok, 1], final[ok])
    assert chi2_pvalue(torch.bincount(second, minlength=v), p[1]) > 1e-3
    # a bonus token is drawn when all k are accepted
    assert (num_accepted == k).any() and (num_accepted == 0).any()


def test_rejection_sample_greedy_is_exact_match():
    v = 6
    target = torch.nn.functional.one_hot(torch.tensor([[2, 4, 1, 5]]), v).float()  # argmax chain
    drafts = torch.tensor([[2, 4, 0]])
    draft_probs = torch.nn.functional.one_hot(drafts, v).float()
    a, nxt = rejection_sample(target, draft_probs, drafts, torch.tensor([3]), torch.rand(1, 3),
                              torch.empty(1, v).exponential_())
    assert a.item() == 2 and nxt.item() == 1  # d3 = 0 rejected, the target's argmax replaces it
    a, nxt = rejection_sample(target, draft_probs[:, :2], drafts[:, :2], torch.tensor([2]), torch.rand(1, 2),
                              torch.empty(1, v).exponential_())
    assert a.item() == 2 and nxt.item() == 1  # all accepted: the bonus token


def exact_distribution(model, prompt: list[int], steps: int) -> torch.Tensor:
    """P(token at output position `steps`-1), marginalized over the tokens before it (V^(steps-1) paths)."""
    v = model.cfg.vocab_size
    paths, weights = torch.tensor([prompt]), torch.ones(1)
    with torch.no_grad():
        for _ in range(steps):
            probs = model(paths)[:, -1].float().softmax(-1)  # (paths, V)
            joint = weights[:, None] * probs
            last = joint.sum(0)
            paths = torch.cat([paths.repeat_interleave(v, 0), torch.arange(v).repeat(len(paths))[:, None]], 1)
            weights = joint.flatten()
    return last


def test_engine_sampled_tokens_follow_target_distribution(byte_tokenizer):
    """Small vocabulary (8), temperature 1, 2 drafts per step: output tokens 2 and 3 (drafted by MTP,
    then accepted or replaced) have the target model's marginal distributions. The draft is made
    sharp and the target broad, so rejections are frequent and a biased rule would show."""
    model = build_model(preset("tiny", vocab_size=8), seed=1).eval()
    with torch.no_grad():
        model.norm.weight.mul_(4)
        model.mtp[0].norm.weight.mul_(40)
    prompt = [1, 2, 3, 4, 5, 6]
    torch.manual_seed(0)
    n = 3000
    # every sequence in one batch: a few large steps instead of many small ones
    llm = LLM(model, byte_tokenizer, num_kv_blocks=2 * n + 8, block_size=8, speculative_tokens=2, max_num_seqs=n,
              max_num_batched_tokens=len(prompt) * n, enable_prefix_caching=False)
    (out,) = llm.generate([prompt], SamplingParams(n=n, temperature=1.0, max_tokens=4, ignore_eos=True))
    for position in (1, 2):
        tokens = torch.tensor([c.token_ids[position] for c in out.outputs])
        expected = exact_distribution(model, prompt, position + 1)
        counts = torch.bincount(tokens, minlength=8)
        keep = expected * n >= 5  # chi-square needs expected counts of at least ~5 per cell
        assert counts[~keep].sum() <= 0.01 * n
        assert chi2_pvalue(counts[keep], expected[keep]) > 1e-3, (position, counts, expected * n)
    spec = llm.engine.spec
    assert 0.05 < spec.acceptance_rate < 0.95, spec.acceptance_rate


def test_metrics_report_acceptance(tiny_model, byte_tokenizer):
    import httpx

    from seekforge.config import EngineConfig
    from tests.serve.conftest import serving

    config = EngineConfig(num_kv_blocks=64, block_size=8, speculative_tokens=2)
    with serving(tiny_model, byte_tokenizer, config) as server:
        r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                                   "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        text = httpx.get(f"{server.base_url}/metrics").text
    drafted = [line for line in text.splitlines() if line.startswith("seekforge_spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert "seekforge_spec_decode_acceptance_rate" in text and "seekforge_spec_decode_mean_accepted_length" in text
