"""Built-in corpora, generated on the fly from a seed (no download), and the arithmetic task that
GRPO reuses as a verifiable reward.

- `builtin:arithmetic`: "Q: 37 + 48 = ? A: 85" at three difficulty levels; harder levels show short
  worked steps before "The answer is N." so a small model can learn to carry and to chain two ops.
- `builtin:text`: tiny templated stories over word lists. The combinations run to billions, so a
  45M model cannot memorize them, but the grammar is regular enough that its loss falls far below
  the unigram entropy of the bytes.
"""

from __future__ import annotations

import random
import re

import numpy as np

# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


class ArithmeticTask:
    """Integer arithmetic questions. Levels:

    1. one op, +/- on 1–2 digit numbers:            "Q: 37 + 48 = ? A: 85"
    2. one op, 2-digit × 1-digit or exact division, with the product split into tens and units
    3. two ops with parentheses, one step per op

    `sample(rng)` → (prompt, answer): prompt ends with "A:" and the answer is the integer as text;
    the model's completion is graded by `check_answer`. `document(rng)` is prompt + worked solution,
    the pretraining text.

    `slip_share` makes the documents imitate a corpus with mistakes: that share of the level-1 answers
    whose units carry (or borrow) is dropped, the commonest slip in written arithmetic ("47 + 38 = 75",
    "52 - 37 = 25"), is printed with the slip. `sample` and `check_answer` always use the true answer.
    """

    def __init__(self, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3), slip_share: float = 0.0):
        if not levels or not set(levels) <= {1, 2, 3}:
            raise ValueError(f"levels={levels}; pick a non-empty subset of (1, 2, 3)")
        if not 0 <= slip_share <= 1:
            raise ValueError(f"slip_share={slip_share}; pick a share in [0, 1]")
        self.levels = tuple(levels)
        self.slip_share = slip_share
        self.rng = random.Random(seed)

    def sample(self, rng: random.Random | None = None) -> tuple[str, str]:
        question, _, answer = self._problem(rng or self.rng)
        return f"Q: {question} = ? A:", str(answer)

    def document(self, rng: random.Random | None = None) -> str:
        rng = rng or self.rng
        question, steps, answer = self._problem(rng)
        if self.slip_share and not steps and rng.random() < self.slip_share:
            answer = dropped_carry(question)
        solution = f"{'; '.join(steps)}. The answer is {answer}." if steps else str(answer)
        return f"Q: {question} = ? A: {solution}"

    def _problem(self, rng: random.Random) -> tuple[str, list[str], int]:
        """→ (question text, worked steps, integer answer)."""
        level = rng.choice(self.levels)
        if level == 1:
            a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
            return f"{a} {op} {b}", [], _apply(a, op, b)
        if level == 2:
            if rng.random() < 0.5:
                a, b = rng.randint(11, 99), rng.randint(2, 9)
                tens, units = a - a % 10, a % 10
                steps = [f"{tens} * {b} = {tens * b}", f"{units} * {b} = {units * b}",
                         f"{tens * b} + {units * b} = {a * b}"]
                return f"{a} * {b}", steps, a * b
            b, quotient = rng.randint(2, 9), rng.randint(2, 30)
            a = b * quotient  # exact division keeps every answer an integer
            return f"{a} / {b}", [f"{b} * {quotient} = {a}"], quotient
        a, b, c = rng.randint(1, 50), rng.randint(1, 50), rng.randint(2, 9)
        inner_op, outer_op = rng.choice("+-"), rng.choice("*+-")
        inner = _apply(a, inner_op, b)
        answer = _apply(inner, outer_op, c)
        steps = [f"{a} {inner_op} {b} = {inner}", f"{inner} {outer_op} {c} = {answer}"]
        return f"({a} {inner_op} {b}) {outer_op} {c}", steps, answer


def dropped_carry(question: str) -> int:
    """The answer to a level-1 question ("47 + 38") with the units carry or borrow dropped: 47 + 38 → 75,
    52 - 37 → 25, 37 - 52 → -25; a question without one keeps its true answer."""
    a, op, b = question.split()
    a, b = int(a), int(b)
    if op == "+":
        return a + b - 10 * (a % 10 + b % 10 >= 10)
    big, small, sign = (a, b, 1) if a >= b else (b, a, -1)
    return sign * (big - small + 10 * (big % 10 < small % 10))


def _apply(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"answer is\s*:?\s*\**\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def check_answer(completion: str, answer: str) -> bool:
    """True when the completion's final answer equals `answer` as a number.

    The final answer is the number after the last "answer is" if present, else the last number.
    Text from a new "Q:" on is ignored (a model often runs on into the next question). Accepted
    variants of 85: " 85", "85.", "85.0", "**85**", "1,085" for 1085, "The answer is: 85".
    Rejected: a different number, no number at all, "85.5" for 85.
    """
    completion = completion.split("Q:", 1)[0]
    finals = _FINAL.findall(completion)
    numbers = finals or _NUMBER.findall(completion)
    if not numbers:
        return False
    try:
        return float(numbers[-1].replace(",", "")) == float(answer.replace(",", ""))
    except ValueError:
        return False


def arithmetic_documents(seed: int):
    """Endless deterministic stream of arithmetic documents."""
    task, rng = ArithmeticTask(), random.Random(seed)
    while True:
        yield task.document(rng)


# ---------------------------------------------------------------------------------------------
# Tiny stories
# ---------------------------------------------------------------------------------------------

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Nora", "Jack",
         "Ella", "Finn", "Ruby", "Owen", "Lucy", "Eli", "Ivy", "Noah"]
ANIMALS = ["cat", "dog", "rabbit", "fox", "bird", "frog", "bear", "duck", "mouse", "owl", "horse", "turtle"]
ADJECTIVES = ["little", "happy", "brave", "shy", "curious", "sleepy", "kind", "silly", "tiny", "clever",
              "quiet", "big"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "white", "black"]
OBJECTS = ["ball", "kite", "box", "book", "hat", "shell", "stone", "key", "cup", "drum", "boat", "flower"]
PLACES = ["forest", "garden", "park", "village", "farm", "beach", "hill", "river", "meadow", "town"]
ACTIVITIES = ["play with friends", "read books", "sing songs", "run in the grass", "look at the stars",
              "help mom", "draw pictures", "climb trees", "swim in the pond", "bake cookies"]
FEELINGS = ["happy", "sad", "surprised", "scared", "proud", "excited", "tired", "angry"]
ENDINGS = ["From that day on, they were best friends.", "It was the best day ever.",
           "Then they went home and had a big dinner.", "They laughed and played until the sun went down.",
           "And everyone lived happily ever after.", "The end."]


def story(rng: random.Random) -> str:
    """One tiny story of 4–7 sentences; the hero's name and pronoun stay consistent throughout."""
    name, friend = rng.sample(NAMES, 2)
    animal, adjective = rng.choice(ANIMALS), rng.choice(ADJECTIVES)
    color, thing, place = rng.choice(COLORS), rng.choice(OBJECTS), rng.choice(PLACES)
    pronoun = rng.choice(["he", "she"])
    sentences = [
        rng.choice([f"Once upon a time, there was a {adjective} {animal} named {name}.",
                    f"{name} was a {adjective} {animal} who lived in a {place}.",
                    f"One day, a {adjective} {animal} called {name} woke up early."]),
        f"{pronoun.capitalize()} liked to {rng.choice(ACTIVITIES)}.",
        rng.choice([f"One day, {name} found {_a(color)} {color} {thing} near the {rng.choice(PLACES)}.",
                    f"{name} saw {_a(color)} {color} {thing} under a tree.",
                    f"In the {place}, {name} lost {'his' if pronoun == 'he' else 'her'} {color} {thing}."]),
        f"{name} felt {rng.choice(FEELINGS)}.",
    ]
    has_friend = rng.random() < 0.7
    if has_friend:
        sentences.append(rng.choice([f"{friend} the {rng.choice(ANIMALS)} came to help.",
                                     f"{pronoun.capitalize()} asked {friend}, \"Do you want to play?\"",
                                     f"{friend} said, \"Let us share the {thing}!\""]))
    if has_friend and rng.random() < 0.5:
        sentences.append(f"Together they {rng.choice(['walked', 'ran', 'danced', 'jumped'])} to the "
                         f"{rng.choice(PLACES)}.")
    sentences.append(rng.choice(ENDINGS))
    return " ".join(sentences)


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def text_documents(seed: int):
    """Endless deterministic stream of tiny stories."""
    rng = random.Random(seed)
    while True:
        yield story(rng)


BUILTIN_CORPORA = {"arithmetic": arithmetic_documents, "text": text_documents}


def unigram_entropy(token_ids) -> float:
    """Entropy in nats (the unit of cross-entropy loss) of the empirical token distribution: the loss
    a model that ignores context would reach. token_ids: ints of any shape (list, array, CPU tensor)."""
    ids = np.asarray(token_ids).ravel()
    if ids.size == 0:
        raise ValueError("unigram_entropy of an empty token sequence is undefined; pass at least one token")
    counts = np.bincount(ids.astype(np.int64) - int(ids.min()))  # shift: bincount needs ids ≥ 0
    p = counts[counts > 0] / ids.size
    return float(-(p * np.log(p)).sum()) if p.size > 1 else 0.0
