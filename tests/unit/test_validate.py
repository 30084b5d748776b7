"""The output checks every 200 response goes through (soakd.client.validate)."""

from __future__ import annotations

import random

import pytest

from soakd.client.validate import check_output, repeats_at_end
from soakd.config import Validation


def tail_repeats(text: str, max_period_words: int = 8) -> int:
    """The reference, the check as it was: how many times the longest-repeating 1..max_period_words word phrase
    repeats at the end, every repeat counted."""
    words = text.split()
    best = 1
    n = len(words)
    for period in range(1, max_period_words + 1):
        if n < 2 * period:
            break
        unit = words[n - period:]
        reps = 1
        i = n - 2 * period
        while i >= 0 and words[i:i + period] == unit:
            reps += 1
            i -= period
        if reps > best:
            best = reps
    return best


def test_each_check_names_its_reason() -> None:
    rules = Validation()
    assert check_output("The answer is 42, as the guide says.", rules) == ""
    assert check_output("  \n ", rules) == "empty_output"
    assert check_output("caf\ufffd au lait and more words here", rules) == "garbled_output"
    assert check_output("Sure. " + "I am sorry " * 16, rules) == "degenerate_repetition"
    assert check_output("Sure. " + "I am sorry " * 15, rules) == ""  # 15 times: under the default 16
    assert check_output("Sure. " + "I am sorry " * 16, Validation(max_repeats=0)) == ""  # the check off


@pytest.mark.parametrize("text", [
    "a b c " + "x y " * 16,
    "word " * 17,
    "one two three four five six seven eight " * 16,  # the longest period, eight words
    "one two three four five six seven eight nine " * 16,  # nine words: beyond the check
    "lead " + "x" * 10_000 + " " + "tail end " * 16,  # the repetition after a long word
    " ".join(["w" * 70] * 16),  # words longer than the tail the check reads
    "z" * 9_000 + "k" + " a b" * 16,  # the tail cut inside a word, which must not count
])
def test_repeats_at_end_answers_as_counting_every_repeat(text: str) -> None:
    for times in (1, 2, 15, 16, 17):
        assert repeats_at_end(text, times) == (tail_repeats(text) >= times), (text[-80:], times)


def test_repeats_at_end_agrees_with_tail_repeats_on_seeded_texts() -> None:
    rng = random.Random(7)
    vocab = ["a", "bb", "the", "cat", "x" * 70, "y" * 200]
    checked = found = 0
    for _ in range(20_000):
        base = [rng.choice(vocab[:4] if rng.random() < 0.9 else vocab) for _ in range(rng.randint(0, 40))]
        unit = [rng.choice(vocab) for _ in range(rng.randint(1, 9))]
        text = rng.choice([" ", "\n", "  "]).join(base + unit * rng.randint(0, 20)) + rng.choice(["", ".", " "])
        if rng.random() < 0.05:
            text = "z" * rng.randint(1, 5000) + " " + text
        for times in (2, 3, 5, 16):
            want = tail_repeats(text) >= times
            assert repeats_at_end(text, times) == want, (text[-300:], times)
            checked += 1
            found += want
    assert found > checked // 10  # both answers are well represented
