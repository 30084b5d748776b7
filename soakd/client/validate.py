"""Output checks that turn a 200 response into ``invalid_response`` with a reason."""

from __future__ import annotations

from soakd.config import Validation

REPLACEMENT = "\ufffd"


def repeats_at_end(text: str, times: int, max_period_words: int = 8) -> bool:
    """Whether a phrase of 1..max_period_words words repeats ``times`` times (or more) at the end, read from the
    end of the text only, with one list comparison a period (every request's output is checked: a 16-token
    stream pays it on every request; tests/unit/test_validate.py holds it to counting every repeat)."""
    if times <= 1:
        return True  # one occurrence is every text's
    need = max_period_words * times  # the words the longest period needs
    cut = need * 64
    if len(text) > cut:
        words = text[-cut:].split()[1:]  # the first may be a word's end
        if len(words) < need:  # words longer than 64 characters on average: the whole text
            words = text.split()
    else:
        words = text.split()
    n = len(words)
    last = words[-1] if words else None
    for period in range(1, max_period_words + 1):
        span = period * times
        if n < span:
            break
        # a period repeated ends each repeat with the same word: one comparison rules most periods out
        if words[-1 - period] == last and words[-span:] == words[-period:] * times:
            return True
    return False


def check_output(text: str, rules: Validation) -> str:
    """Return '' when the output passes, otherwise the reason."""
    if rules.non_empty and not text.strip():
        return "empty_output"
    if rules.replacement_chars and REPLACEMENT in text:
        return "garbled_output"
    if rules.max_repeats and len(text) > 16 and repeats_at_end(text, rules.max_repeats):
        return "degenerate_repetition"
    return ""


def check_structure(text: str, kind: str) -> str:
    """code_completion's optional structure check."""
    if kind == "brackets":
        pairs = {")": "(", "]": "[", "}": "{"}
        stack: list[str] = []
        for ch in text:
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                if not stack or stack.pop() != pairs[ch]:
                    return "unbalanced_brackets"
        return "unbalanced_brackets" if stack else ""
    if kind == "fenced_block":
        return "" if text.count("```") >= 2 else "no_fenced_block"
    return ""
