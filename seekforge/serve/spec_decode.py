"""MTP speculative decoding: the model's own MTP modules draft k tokens, one target pass verifies them.

Per engine step (`--speculative-tokens k`):
  verify  — each decoding sequence runs [last token, d1 … dk] through the main model as 1 + k decode
            rows (kv_cache.py); `rejection_sample` accepts a prefix of the drafts and draws one more
            token, so the output distribution is the target model's (Leviathan et al. 2023, Chen et al.
            2023). Greedy requests are the one-hot case: drafts are accepted while they equal the
            target's argmax. Rejected drafts' cache slots are rolled back by not counting them as
            computed (`num_computed_tokens`); the next pass overwrites them, and block hashes only
            ever cover accepted tokens (BlockManager.cache_full_blocks reads num_computed_tokens).
  propose — MTP module 1 runs over every position the main model verified this step, at position t
            taking the main model's hidden h_t BEFORE its final norm and the embedding of token t+1
            (what training does: model/loss.py mtp_losses says why, and where vLLM and SGLang
            differ), which also fills its own latent cache; its output at the last
            position drafts d1. Draft s > 1 chains at position t+s-1 from draft s-1's output (before
            the module's norm) and d_{s-1}, with module min(s, D) of the D MTP modules — the last one
            repeated when k > D, as vLLM and SGLang do.
Structured-output sequences (a grammar matcher) are never drafted for, so in a verify pass they
score one row under their grammar's current mask, as a plain step would; the batch around them still
speculates. Prompt logprobs come from the verified prefill rows, as in Runner.run.

Shape legend: N sequences, K most drafts of any, V vocabulary, H hidden.
"""

from __future__ import annotations

import torch

from seekforge.serve.block_manager import BlockManager
from seekforge.serve.runner import Chunk, Runner, chunks_of, prompt_rows
from seekforge.serve.sampling import adjusted_logits, exponential_noise, logprob_infos, token_probs
from seekforge.serve.scheduler import ScheduledBatch
from seekforge.serve.sequence import Sequence, SequenceAhead, SequenceUpdate


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor):
    """Speculative sampling for N sequences.

    target_probs (N, K+1, V): the target's distribution at each draft position and after the last;
    draft_probs (N, K, V): the distribution draft j was drawn from; draft_ids (N, K); num_drafts (N,)
    (row i uses its first num_drafts[i] drafts); uniforms (N, K) U[0, 1); noise (N, V) Exp(1).
    Draft j is accepted, while all before it were, with probability min(1, p_j(d_j) / q_j(d_j)); the
    first rejected position draws from max(p_j − q_j, 0) normalized, and when every draft is accepted
    the bonus token draws from p at the position after the last. Returns (num_accepted (N,),
    next token (N,)). Draws use the exponential race argmax(w / E), which needs no normalization."""
    n, k = draft_ids.shape
    rows = torch.arange(n, device=draft_ids.device)
    p_draft = target_probs[:, :k].gather(2, draft_ids[..., None])[..., 0]  # (N, K)
    q_draft = draft_probs.gather(2, draft_ids[..., None])[..., 0]
    accept = (uniforms * q_draft < p_draft) & (torch.arange(k, device=draft_ids.device) < num_drafts[:, None])
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepted drafts
    p_next = target_probs[rows, num_accepted]  # (N, V)
    dist = p_next
    if k:
        residual = (p_next - draft_probs[rows, num_accepted.clamp(max=k - 1)]).clamp(min=0)
        # p == q exactly is always accepted, so a rejection leaves mass; guard fp rounding anyway
        use_residual = (num_accepted < num_drafts) & (residual.sum(dim=-1) > 0)
        dist = torch.where(use_residual[:, None], residual, p_next)
    return num_accepted, (dist / noise).argmax(dim=-1)


class SpecDecoder:
    """Drives the runner for speculative steps; counts drafted and accepted tokens."""

    def __init__(self, runner: Runner, block_manager: BlockManager, num_speculative_tokens: int,
                 max_model_len: int):
        if not runner.model.mtp:
            raise ValueError("speculative_tokens > 0 needs MTP modules, but the model has "
                             "num_nextn_predict_layers=0; drop --speculative-tokens")
        self.runner = runner
        self.block_manager = block_manager
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifies = 0  # (sequence, step) pairs that verified at least one draft
        self._pending: list[tuple[Chunk, torch.Tensor]] = []  # verified chunks and their pre-norm hidden

    # ------------------------------------------------------------------ stats
    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verify pass: accepted drafts + the one sampled token."""
        return 1 + self.num_accepted_tokens / self.num_verifies if self.num_verifies else 0.0

    # ------------------------------------------------------------------ verify
    @torch.inference_mode()
    def verify(self, batch: ScheduledBatch) -> list[SequenceUpdate]:
        runner = self.runner
        self._pending = []
        chunks = chunks_of(batch)
        hidden, rows = runner.forward(chunks)  # (T, H) before the final norm
        normed = runner.model.norm(hidden)
        # prompt logprobs come from prefill rows, which carry no drafts: the same rows as a plain step's
        prompt = {seq.seq_id: runner.model.lm_head(normed[r]).float() for seq, r in prompt_rows(chunks, rows)}
        updates, sampling = [], []
        for c, r in zip(chunks, rows, strict=True):
            num_drafts = len(c.seq.draft_token_ids[:len(c.token_ids) - 1]) if c.decode else 0
            num_real = len(c.token_ids) - num_drafts
            updates.append(SequenceUpdate(c.seq, num_real, prompt_logits=prompt.get(c.seq.seq_id)))
            if c.start + num_real == c.seq.num_tokens:  # reaches its last known token: samples
                sampling.append((updates[-1], r + num_real - 1, num_drafts))
            self._pending.append((c, hidden[r:r + len(c.token_ids)]))  # MTP takes the pre-norm hidden
        if sampling:
            self._accept(sampling, normed)
        return updates

    def _accept(self, sampling: list[tuple[SequenceUpdate, int, int]], normed: torch.Tensor) -> None:
        """Score each sampling sequence's rows (its last real token, then its drafts), accept, fill the
        updates."""
        runner = self.runner
        k = max(n for _, _, n in sampling)
        row_index = torch.tensor([min(r + j, r + n) for _, r, n in sampling for j in range(k + 1)])
        raw = runner.model.lm_head(normed[row_index.to(normed.device)]).float()  # (N·(K+1), V), padding repeats
        views = [SequenceAhead(u.seq, u.seq.draft_token_ids[:min(j, n)]) for u, _, n in sampling
                 for j in range(k + 1)]
        target = token_probs(adjusted_logits(raw, views), views).view(len(sampling), k + 1, -1)  # (N, K+1, V)
        vocab = target.shape[-1]
        device = target.device
        seqs = [u.seq for u, _, _ in sampling]
        draft_ids = torch.zeros(len(seqs), k, dtype=torch.long)
        draft_probs = torch.zeros(len(seqs), k, vocab, device=device)
        uniforms = torch.zeros(len(seqs), k)
        for i, (seq, (_, _, n)) in enumerate(zip(seqs, sampling, strict=True)):
            if n:
                draft_ids[i, :n] = torch.tensor(seq.draft_token_ids[:n])
                draft_probs[i, :n] = seq.draft_probs[:n] if seq.draft_probs is not None else \
                    torch.zeros(n, vocab, device=device).scatter_(1, draft_ids[i, :n, None].to(device), 1.0)
                uniforms[i, :n] = torch.rand(n, generator=seq.generator) if seq.generator is not None \
                    and not seq.params.greedy else torch.rand(n)
        num_drafts = torch.tensor([n for _, _, n in sampling])
        num_accepted, next_ids = rejection_sample(target, draft_probs, draft_ids.to(device), num_drafts.to(device),
                                                  uniforms.to(device), exponential_noise(seqs, 1, vocab, device))
        for i, (update, _, n) in enumerate(sampling):
            a = int(num_accepted[i])
            update.num_accepted = a
            update.token_ids = update.seq.draft_token_ids[:a] + [int(next_ids[i])]
            if n:
                self.num_draft_tokens += n
                self.num_accepted_tokens += a
                self.num_verifies += 1
            if update.seq.params.logprobs is not None:
                raw_rows = raw.view(len(sampling), k + 1, -1)[i, :a + 1]
                ids = torch.tensor(update.token_ids, device=raw.device)
                update.infos = logprob_infos(raw_rows, ids, views[i * (k + 1):i * (k + 1) + a + 1], update.token_ids)
            else:
                update.infos = [None] * (a + 1)
            update.seq.draft_token_ids, update.seq.draft_probs = [], None

    # ------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self) -> None:
        """Run MTP module 1 over what this step verified, then draft for the sequences still running.
        Call after the engine applied the updates (tokens appended, num_computed_tokens advanced)."""
        pending, self._pending = self._pending, []
        chunks, h_prev = [], []
        for c, hidden_before_norm in pending:
            seq = c.seq
            # a constrained sequence gets no drafts: scoring them would need its grammar matcher advanced
            # over unverified tokens and rolled back on rejection; it verifies just its one real token
            if seq.is_finished or seq.matcher is not None:
                continue
            verified = seq.num_computed_tokens - c.start  # positions c.start … whose latents were kept
            if verified <= 0:
                continue
            # position t carries token t+1 (known for every verified position: the last one's is the new token)
            next_ids = seq.token_ids[c.start + 1:c.start + 1 + verified]
            chunks.append(Chunk(seq, c.start, next_ids, c.decode))
            h_prev.append(hidden_before_norm[:verified])
        if not chunks:
            return
        runner = self.runner
        hidden, rows = runner.forward_mtp(0, chunks, h_prev)
        drafting = []  # (seq, number of drafts, hidden at its last position)
        for c, r in zip(chunks, rows, strict=True):
            seq = c.seq
            if c.start + len(c.token_ids) != seq.num_tokens - 1:
                continue  # mid-prefill: nothing to draft yet
            remaining = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
            n = min(self.k, remaining - 1)  # the verify pass always adds one more token after the drafts
            if n > 1 and not self.block_manager.allocate(seq, n - 1):  # chained drafts write their slots
                n = 1
            if n >= 1:
                drafting.append((seq, n, hidden[r + len(c.token_ids) - 1]))
        seqs = [s for s, _, _ in drafting]
        h = torch.stack([x for _, _, x in drafting]) if drafting else None
        num_modules = len(runner.model.mtp)
        for step in range(max((n for _, n, _ in drafting), default=0)):
            if step:  # chain: module min(step, D-1) at the next position, from the last draft
                live = [i for i, (_, n, _) in enumerate(drafting) if n > step]
                depth = min(step, num_modules - 1)
                chunks = [Chunk(seqs[i], seqs[i].num_tokens - 2 + step, [seqs[i].draft_token_ids[-1]], True)
                          for i in live]
                out, out_rows = runner.forward_mtp(depth, chunks, [h[i:i + 1] for i in live])
                h = h.clone()
                h[live] = out[out_rows]
            else:
                live, depth = list(range(len(drafting))), 0
            self._draw([seqs[i] for i in live], runner.logits(h[live], runner.model.mtp[depth].norm))

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Draw one more draft for each of `seqs` from its MTP logits (N, V), through the request's own
        sampling settings (greedy requests take the argmax), and remember the distribution."""
        views = [SequenceAhead(s, list(s.draft_token_ids)) for s in seqs]
        probs = token_probs(adjusted_logits(logits, views), views)  # (N, V)
        ids = (probs / exponential_noise(views, 1, probs.shape[1], probs.device)).argmax(dim=-1).tolist()
        for seq, token, q in zip(seqs, ids, probs, strict=True):
            seq.draft_token_ids.append(token)
            if not seq.params.greedy:
                q = q[None]
                seq.draft_probs = q if seq.draft_probs is None else torch.cat([seq.draft_probs, q])
