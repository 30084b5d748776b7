"""Output checks that turn a 200 response into ``invalid_response`` with a reason."""

from __future__ import annotations

from soakd.config import Validation

REPLACEMENT = "\ufffd"


def tail_repeats(text: str, max_period_words: int = 8) -> int:
    """How many times the longest-repeating 1..max_period_words word phrase repeats at the end."""
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


def check_output(text: str, rules: Validation) -> str:
    """Return '' when the output passes, otherwise the reason."""
    if rules.non_empty and not text.strip():
        return "empty_output"
    if rules.replacement_chars and REPLACEMENT in text:
        return "garbled_output"
    if rules.max_repeats and len(text) > 16 and tail_repeats(text) >= rules.max_repeats:
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
