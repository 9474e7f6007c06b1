"""The built-in base's pretraining documents leave out the GRPO run's held-out questions."""

from __future__ import annotations

from seekforge.model.tokenizer import load_tokenizer
from seekforge.rl.base import TaskWindows
from seekforge.rl.trainer import PromptStream


def test_base_documents_leave_out_the_held_out_questions():
    tokenizer = load_tokenizer("byte")
    held_out = frozenset(prompt for prompt, _ in PromptStream([2], seed=0, num_eval=200).eval_set)
    windows = TaskWindows(tokenizer, [2], seq_len=128, num_windows=64, seed=0, held_out=held_out)
    text = tokenizer.decode([int(t) for w in windows.windows for t in w])
    assert not [prompt for prompt in held_out if prompt in text]
    everything = TaskWindows(tokenizer, [2], seq_len=128, num_windows=64, seed=0)
    text = tokenizer.decode([int(t) for w in everything.windows for t in w])
    assert [prompt for prompt in held_out if prompt in text]  # level 2 repeats questions: the filter matters
