"""Built-in corpora: deterministic, varied, and the arithmetic checker grades correctly."""

import random

import numpy as np
import pytest

from seekforge.data.corpora import ArithmeticTask, check_answer, dropped_carry, story, text_documents, unigram_entropy


@pytest.mark.parametrize("completion", [" 85", "85", "85.", "85.0", " **85**", "The answer is 85.",
                                        "80 + 5 = 85. The answer is: 85", " 85\nQ: 1 + 2 = ? A: 3",
                                        "7 + 8 = 15; 70 + 15 = 85. The answer is 85.\n"])
def test_check_answer_accepts(completion):
    assert check_answer(completion, "85")


@pytest.mark.parametrize("completion", ["", " 84", "85.5", "eighty-five", " 8 5", "The answer is 84. 85",
                                        " -85", "850"])
def test_check_answer_rejects(completion):
    assert not check_answer(completion, "85")


def test_check_answer_formats():
    assert check_answer("The answer is 1,085.", "1085")
    assert check_answer(" -12", "-12") and not check_answer(" 12", "-12")


def test_task_answers_are_right():
    """The worked solution in every document ends in the answer `sample` reports, and that answer
    equals evaluating the question."""
    task = ArithmeticTask(seed=0)
    for i in range(300):
        prompt, answer = task.sample(random.Random(i))
        document = task.document(random.Random(i))
        assert document.startswith(prompt)
        assert check_answer(document[len(prompt):], answer)
        question = prompt.removeprefix("Q: ").removesuffix(" = ? A:")
        assert eval(question.replace("/", "//")) == int(answer)  # noqa: S307 — our own generated text


def test_dropped_carry_slips_exactly_the_carried_answers():
    assert [dropped_carry(q) for q in ("47 + 38", "52 - 37", "37 - 52", "30 - 7", "5 + 7", "91 + 55", "21 + 18")] == \
        [75, 25, -25, 33, 2, 146, 39]
    task = ArithmeticTask(seed=0, levels=(1,))
    for i in range(500):
        question = task.sample(random.Random(i))[0].removeprefix("Q: ").removesuffix(" = ? A:")
        a, op, b = question.split()
        a, b = int(a), int(b)
        carried = (a % 10 + b % 10 >= 10) if op == "+" else (max(a, b) % 10 < min(a, b) % 10)
        assert (dropped_carry(question) != eval(question)) == carried  # noqa: S307 — our own generated text
        assert abs(dropped_carry(question) - eval(question)) in (0, 10)  # noqa: S307


def test_slip_share_changes_only_the_documents():
    """slip_share 1 prints every carried answer with the slip; 0 leaves the document stream as it was
    (no extra random draw); sample() always reports the true answer."""
    clean, slipped = ArithmeticTask(0, (1,)), ArithmeticTask(0, (1,), slip_share=1.0)
    for i in range(200):
        assert slipped.sample(random.Random(i)) == clean.sample(random.Random(i))
        prompt, answer = clean.sample(random.Random(i))
        question = prompt.removeprefix("Q: ").removesuffix(" = ? A:")
        assert slipped.document(random.Random(i)) == f"{prompt} {dropped_carry(question)}"
        assert clean.document(random.Random(i)) == f"{prompt} {answer}"
    with pytest.raises(ValueError, match="slip_share"):
        ArithmeticTask(slip_share=1.5)


def test_task_is_seeded():
    assert [ArithmeticTask(3).sample() for _ in range(5)] == [ArithmeticTask(3).sample() for _ in range(5)]
    assert [ArithmeticTask(3).sample() for _ in range(5)] != [ArithmeticTask(4).sample() for _ in range(5)]
    with pytest.raises(ValueError, match="levels"):
        ArithmeticTask(levels=(4,))


def test_stories_vary_and_repeat_by_seed():
    a, b = text_documents(0), text_documents(0)
    first = [next(a) for _ in range(200)]
    assert first == [next(b) for _ in range(200)]
    assert len(set(first)) == 200  # no duplicates among 200 stories
    assert first[:5] != [story(random.Random(1)) for _ in range(5)]


def test_unigram_entropy_nats():
    assert unigram_entropy([7, 7, 7]) == 0.0
    assert unigram_entropy([0, 1, 2, 3]) == pytest.approx(np.log(4), rel=1e-12)
    with pytest.raises(ValueError, match="empty"):
        unigram_entropy([])
