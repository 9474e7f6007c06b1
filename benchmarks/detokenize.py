"""Streaming detokenization cost per token: the incremental detokenizer vs the full re-decode it replaced.

    python benchmarks/detokenize.py

One 2,000-token output is streamed token by token, as the engine does for one sequence: append the
token, check the stop strings, produce the text that may be streamed. Measured per token and reported
at tokens 100, 500, 1,000 and 2,000 (median over the 50 tokens ending there, best of 5 runs):

    full re-decode — the engine before: decode every output token again for the stop check and again
                     for the streamed text (O(n) per token, O(n²) per request)
    incremental    — seekforge.serve.detokenizer: decode only the tokens since the last emitted
                     character (O(1) per token)

for the byte tokenizer and a byte-level BPE `tokenizer.json` (trained here on the text streamed, so it
has real merges) through the `tokenizers` library. Flat per-token time from token 100 to 2,000 is
what O(n) per request looks like; the full re-decode grows linearly.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time

import torch

from seekforge.model.tokenizer import ByteTokenizer, HFTokenizer
from seekforge.serve.detokenizer import IncrementalDetokenizer

NUM_TOKENS, POSITIONS, WINDOW, REPEATS = 2000, (100, 500, 1000, 2000), 50, 5
STOP = ["\nUser:"]  # a chat stop string, never in the text: every token is checked, none stops
TEXT = ("The paged latent cache keeps c_kv and k_pe per token; 漢字 and émojis 😀 take several bytes. "
        "Prefix caching reuses full blocks, and chunked prefill shares steps with decodes. ") * 60


def bpe_tokenizer(directory: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(f"{directory}/tokenizer.json")
    return HFTokenizer(directory)


def stream_full_redecode(tokenizer, ids: list[int]) -> list[int]:
    """The engine's detokenization before the incremental detokenizer (engine.py `_check_stop` + `_text`)."""
    times, text, longest = [], "", max(len(s) for s in STOP)
    for n in range(1, len(ids) + 1):
        start = time.perf_counter_ns()
        full = tokenizer.decode(ids[:n])
        search_from = max(0, len(text) - longest)
        hits = [i for i in (full.find(s, search_from) for s in STOP) if i >= 0]
        text = full[:min(hits)] if hits else full
        shown = tokenizer.decode(ids[:n]).rstrip("\ufffd")
        shown = shown[:max(0, len(shown) - longest + 1)]
        times.append(time.perf_counter_ns() - start)
    return times


def stream_incremental(tokenizer, ids: list[int]) -> list[int]:
    times, detok = [], IncrementalDetokenizer(tokenizer, STOP)
    for token_id in ids:
        start = time.perf_counter_ns()
        detok.add(token_id)
        shown = detok.streamable_text  # noqa: F841 - what the engine hands to the stream
        times.append(time.perf_counter_ns() - start)
    return times


def per_token_us(stream, tokenizer, ids) -> dict[int, float]:
    """µs per token at each position: median over the WINDOW tokens ending there, best of REPEATS."""
    runs = [stream(tokenizer, ids) for _ in range(REPEATS)]
    return {p: min(statistics.median(r[p - WINDOW:p]) for r in runs) / 1000 for p in POSITIONS}


def main():
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, {platform.processor() or platform.machine()},"
          f" Python {platform.python_version()}; {NUM_TOKENS}-token stream, stop={STOP!r}")
    with tempfile.TemporaryDirectory() as directory:
        tokenizers = {"byte": ByteTokenizer(), "bpe (tokenizers)": bpe_tokenizer(directory)}
        for name, tokenizer in tokenizers.items():
            ids = tokenizer.encode(TEXT)[:NUM_TOKENS]
            assert len(ids) == NUM_TOKENS, f"the text gives only {len(ids)} {name} tokens"
            old = per_token_us(stream_full_redecode, tokenizer, ids)
            new = per_token_us(stream_incremental, tokenizer, ids)
            print(f"\n{name} tokenizer: µs per token (full re-decode vs incremental, same run)")
            print(f"{'token':>7} {'full re-decode':>15} {'incremental':>12} {'ratio':>7}")
            for p in POSITIONS:
                print(f"{p:>7} {old[p]:>15.2f} {new[p]:>12.2f} {old[p] / new[p]:>6.1f}x")
            first, last = POSITIONS[0], POSITIONS[-1]
            print(f"growth {first} -> {last}: full re-decode {old[last] / old[first]:.1f}x, "
                  f"incremental {new[last] / new[first]:.2f}x")


if __name__ == "__main__":
    main()
