"""The built-in base's pretraining documents leave out the GRPO run's held-out questions."""

from __future__ import annotations

from seekforge.model.tokenizer import load_tokenizer
from seekforge.rl.base import StopRule, TaskWindows
from seekforge.rl.data import ArithmeticPrompts


def test_base_documents_leave_out_the_held_out_questions():
    tokenizer = load_tokenizer("byte")
    held_out = frozenset(s.prompt for s in ArithmeticPrompts([2], seed=0, num_eval=200).eval_set)
    windows = TaskWindows(tokenizer, [2], seq_len=128, num_windows=64, seed=0, held_out=held_out)
    text = tokenizer.decode([int(t) for w in windows.windows for t in w])
    assert not [prompt for prompt in held_out if prompt in text]
    everything = TaskWindows(tokenizer, [2], seq_len=128, num_windows=64, seed=0)
    text = tokenizer.decode([int(t) for w in everything.windows for t in w])
    assert [prompt for prompt in held_out if prompt in text]  # level 2 repeats questions: the filter matters


def test_the_base_stops_at_the_target_or_on_a_plateau_above_the_floor():
    def stop_index(curve, target=0.6, patience=3):
        rule = StopRule(target, patience)
        return next((i, reason) for i, accuracy in enumerate(curve) if (reason := rule.check(accuracy)))

    # the slow creep before the jump never counts as a plateau, however flat
    creep = [0.01, 0.02, 0.02, 0.02, 0.01, 0.02, 0.02, 0.02]
    assert stop_index(creep + [0.3, 0.45, 0.5, 0.48, 0.49, 0.5, 0.47]) == (13, "plateau")
    assert stop_index(creep + [0.3, 0.61]) == (9, "target")
    # a new best restarts the count
    assert stop_index([0.4, 0.3, 0.3, 0.41, 0.4, 0.4, 0.4]) == (6, "plateau")
    rule = StopRule(0.6, patience=0)  # 0: only the target (or base_steps) ends it
    assert not any(rule.check(a) for a in [0.5] * 50)
