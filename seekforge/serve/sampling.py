"""Batched sampling: one pass over the (N, V) logits of all sequences that sample this step.

Order, per row: penalties (repetition over prompt + output; presence / frequency over output) →
the structured-output grammar's mask (structured.py) → stop tokens masked until min_tokens →
temperature → top-k, top-p, min-p (one sort serves all three) → draw.
Greedy rows take the argmax of the penalized, masked logits.

The draw uses the exponential-race form of sampling: argmax(p / E) with E ~ Exp(1) i.i.d. picks index
i with probability p_i, and lets every row draw from its own stream: seeded sequences fill their
row of E from their own torch.Generator (V draws per token, whatever else is in the batch), so a
seeded request gives the same tokens alone or in any batch. Unseeded rows share one global draw.

Logprobs are those of the model's distribution (log_softmax of the raw logits, before penalties and
temperature), as vLLM reports by default.

On a GPU, sampling runs on the device without waiting for it (serve/graphs.py: the engine's one wait per step
is its read of the sampled ids): the per-row settings go up from pinned memory, non_blocking (`device_tensor`),
and no branch reads a tensor's value.
"""

from __future__ import annotations

import torch

from seekforge.serve.sequence import Sequence
from seekforge.serve.structured import allowed_tokens


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Python values → a tensor on `device`. To a GPU from pinned memory, non_blocking: torch.tensor(values,
    device="cuda") copies from pageable memory, which waits for every kernel queued on the stream first."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (N, V) → penalized copy; rows without penalties are unchanged."""
    n, v = logits.shape
    device = logits.device

    def counts_of(id_lists):  # (N, V) occurrences, via one scatter_add over a padded (N, Lmax) tensor
        width = max(1, max(len(ids) for ids in id_lists))
        padded = torch.full((n, width), v, dtype=torch.long, pin_memory=device.type == "cuda")
        for i, ids in enumerate(id_lists):
            padded[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        counts = torch.zeros(n, v + 1, device=device)  # column v collects the padding
        counts.scatter_add_(1, padded.to(device, non_blocking=True), torch.ones(n, width, device=device))
        return counts[:, :v]

    output_counts = counts_of([s.output_token_ids for s in seqs])
    params = [s.params for s in seqs]
    presence = device_tensor([p.presence_penalty for p in params], device)[:, None]
    frequency = device_tensor([p.frequency_penalty for p in params], device)[:, None]
    logits = logits - presence * (output_counts > 0) - frequency * output_counts
    if any(p.repetition_penalty != 1 for p in params):
        repetition = device_tensor([p.repetition_penalty for p in params], device)[:, None]
        seen = (output_counts > 0) | (counts_of([s.token_ids[:s.num_prompt_tokens] for s in seqs]) > 0)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """logits (N, V) already divided by temperature; top_k (N,) (0 = off), top_p, min_p (N,).
    Returns logits with the filtered-out entries at -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    # top-k first; top-p then applies to the renormalized survivors (as generate.sample_next does)
    sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]  # keep the smallest set reaching top_p
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def adjusted_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (N, V) → penalized, masked to what each row's grammar allows next, with stop tokens
    masked until min_tokens: what greedy rows argmax and sampled rows scale by temperature. Returns
    `logits` itself when nothing applies. A row's mask is its matcher's current state, so each row
    must be its sequence's next token (no speculative draft rows for constrained sequences)."""
    if any(s.params.has_penalties for s in seqs):
        logits = apply_penalties(logits, seqs)
    masked = logits
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:  # structured output: only the tokens the grammar allows next
        allowed = allowed_tokens([seqs[i].matcher for i in constrained], logits.shape[1]).to(logits.device)
        masked = logits.clone()
        masked[constrained] = masked[constrained].masked_fill(~allowed, float("-inf"))
    for i, seq in enumerate(seqs):
        # (not under a grammar: where it allows only EOS, masking EOS would leave nothing to sample)
        if seq.num_output_tokens < seq.params.min_tokens and seq.stop_token_ids and seq.matcher is None:
            if masked is logits:
                masked = logits.clone()
            masked[i, list(seq.stop_token_ids)] = float("-inf")
    return masked


def token_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """adjusted logits (N, V) → the distribution each row draws from (N, V): temperature, top-k,
    top-p, min-p, softmax; a greedy row is one-hot at its argmax (speculative decoding verifies
    greedy and sampled rows with the same rejection rule, spec_decode.py)."""
    params = [s.params for s in seqs]
    device = logits.device
    temperature = device_tensor([1.0 if p.greedy else p.temperature for p in params], device)
    scaled = logits / temperature[:, None]
    if any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params):
        scaled = filter_logits(scaled, device_tensor([p.top_k for p in params], device),
                               device_tensor([p.top_p for p in params], device),
                               device_tensor([p.min_p for p in params], device))
    probs = scaled.softmax(dim=-1)
    if any(p.greedy for p in params):
        is_greedy = device_tensor([p.greedy for p in params], device)
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(is_greedy[:, None], one_hot, probs)
    return probs


def exponential_noise(seqs: list[Sequence], num_rows_per_seq: int, vocab: int, device) -> torch.Tensor:
    """Exp(1) noise (N · num_rows_per_seq, V) for exponential-race draws, seq i owning rows
    i·num_rows_per_seq …; a seeded sequence fills its rows from its own generator.

    Drawn as −log U, U ~ Uniform[0, 1): torch's CPU `exponential_` is a scalar loop, several times slower
    than a vectorized uniform_ and log_, and sampling draws one row per sequence per step."""
    noise = torch.empty(len(seqs) * num_rows_per_seq, vocab, device=device)
    seeded = [i for i, seq in enumerate(seqs) if seq.generator is not None and not seq.params.greedy]
    if len(seeded) < len(seqs):
        noise.uniform_()
    for i in seeded:
        rows = noise[i * num_rows_per_seq:(i + 1) * num_rows_per_seq]
        if noise.device.type == "cpu":  # in place, from the sequence's (CPU) generator
            rows.uniform_(generator=seqs[i].generator)
        else:  # drawn on the host (the generator's), sent up without waiting for the stream
            drawn = torch.empty(num_rows_per_seq, vocab, pin_memory=True).uniform_(generator=seqs[i].generator)
            rows.copy_(drawn, non_blocking=True)
    return noise.log_().neg_()


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
    """logits (N, V) fp32 for seqs → next token ids and, per row, logprob info (None if not asked). The ids are
    read with one .tolist(): a step's one device→host copy where no row asks for logprobs."""
    next_ids = sample_ids(logits, seqs)
    token_ids = next_ids.tolist()
    return token_ids, logprob_infos(logits, next_ids, seqs, token_ids)


def sample_ids(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (N, V) → next token ids (N,) on logits' device (multi-step decoding feeds them straight
    back into the model)."""
    adjusted = adjusted_logits(logits, seqs)
    greedy_ids = adjusted.argmax(dim=-1)
    if all(s.params.greedy for s in seqs):
        return greedy_ids
    probs = token_probs(adjusted, seqs)
    sampled = (probs / exponential_noise(seqs, 1, probs.shape[1], probs.device)).argmax(dim=-1)
    is_greedy = device_tensor([s.params.greedy for s in seqs], logits.device)
    return torch.where(is_greedy, greedy_ids, sampled)


def logprob_infos(raw: torch.Tensor, next_ids: torch.Tensor, seqs: list[Sequence],
                  token_ids: list[int]) -> list[dict | None]:
    """raw logits (N, V), the chosen ids (N,) and the same ids read already → per row {"token_id", "logprob",
    "top"} for the sequences that asked for logprobs, else None."""
    params = [s.params for s in seqs]
    infos: list[dict | None] = [None] * len(seqs)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        rows = torch.tensor(wanted, device=raw.device)
        logp = raw[rows].log_softmax(dim=-1)
        chosen = logp.gather(1, next_ids[rows, None])[:, 0].tolist()
        k = max(params[i].logprobs for i in wanted)
        top = logp.topk(k, dim=-1) if k else None
        for j, i in enumerate(wanted):
            ki = params[i].logprobs
            top_pairs = list(zip(top.indices[j, :ki].tolist(), top.values[j, :ki].tolist(), strict=True)) if ki else []
            infos[i] = {"token_id": token_ids[i], "logprob": chosen[j], "top": top_pairs}
    return infos


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[dict]:
    """logits (R, V) fp32 and the R tokens that followed → per row {"token_id", "logprob", "rank" (1 =
    the most likely token), "top": [(id, logprob)] × k}: prompt logprobs, as vLLM reports them."""
    logp = logits.log_softmax(dim=-1)
    targets = torch.tensor(token_ids, device=logits.device)[:, None]  # (R, 1)
    chosen = logp.gather(1, targets)  # (R, 1)
    ranks = (logp > chosen).sum(dim=-1) + 1
    top = logp.topk(k, dim=-1) if k else None
    return [{"token_id": t, "logprob": lp, "rank": r,
             "top": list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)) if k else []}
            for i, (t, lp, r) in enumerate(zip(token_ids, chosen[:, 0].tolist(), ranks.tolist(), strict=True))]
