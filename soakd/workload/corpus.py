"""A deterministic synthetic corpus: common English words that BPE tokenizers (GPT-2/Llama/
Qwen families) encode as one token each with their leading space, so N words ≈ N tokens.

A prompt is a slice of a long seeded word stream at a seeded offset: cheap (no per-word RNG
call on the hot path), reproducible from the seed, and practically never the same prefix
twice, so server prefix caches do not make later windows faster than earlier ones.
"""

from __future__ import annotations

import itertools
import random
import re
from array import array

_TOKEN_ESTIMATE = re.compile(r"\w+|[^\w\s]")


def estimate_tokens(text: str) -> int:
    """Rough token count of arbitrary text: one per word, one per punctuation or symbol character."""
    return len(_TOKEN_ESTIMATE.findall(text))

WORDS = tuple(
    """the of and to in is was that for on as with by he at from his it an were are which this
    be or had not but first one their its new after who they have her she two been other when
    there all during into school time may years more most only over city some world would where
    later up such used many can state about national out known university united then made
    also team three under most both while between part age well since number people four year
    group because could them series season said like each before through being area long war
    family any so high very through game history second since we what until will against five
    music life including three early way life name work public government film north south east
    west several based around took well order even end place around however government own
    local members found early system following back much day part just last major within
    released due large often became general house history these following since among six
    best water light house power field line point small river land market court church free
    little great right old set open main body road island long without home court less top
    service run study days line take law group make head data lower same place next air start
    form among north design again large another area short full every further above above
    king love town party language game side music single person left hand white black red
    green blue gold black play book books field young word words fire earth heart money
    model model building station center central office common report human force value plan
    note result south level rate cost change space price class center current control
    private range river point close board trade story close paper media health union process
    action period return country village church garden machine energy memory network
    signal engine window measure sample window stable result speed cache device server
    request token window driver memory limit clock power heat fan board chip test check""".split()
)

CODE_NAMES = tuple(
    """parse load save merge split sort filter reduce count compute update build render fetch
    encode decode normalize validate flatten resolve schedule collect export import scan
    read write open close apply transform score rank index cache retry""".split()
)
CODE_NOUNS = tuple(
    """items records users rows tokens events values nodes edges paths lines config buffer
    queue batch window samples metrics results entries blocks files keys""".split()
)


class Corpus:
    """A seeded stream of ``size`` words; prompts are slices of it. The words are also kept joined, with each
    word's start, so that a prompt is one string slice (every request builds one: at thousands of requests a
    second, joining a list slice of its words was a measurable share of soakd's CPU)."""

    def __init__(self, seed: int, size: int = 1 << 18) -> None:
        rng = random.Random(f"soakd-corpus-{seed}")
        self.words = rng.choices(WORDS, k=size)
        self.size = size
        self.joined = " ".join(self.words)
        # starts[i]: where word i begins in ``joined`` (starts[size]: one past the end, as if a space followed)
        self.starts = array("l", itertools.accumulate((len(w) + 1 for w in self.words), initial=0))

    def text(self, rng: random.Random, n_words: int) -> str:
        """``n_words`` consecutive words from a random offset, space-separated (``" ".join`` of them)."""
        n = max(1, n_words)
        if n >= self.size:
            reps = n // self.size + 1
            return " ".join((self.words * reps)[:n])
        off = rng.randrange(0, self.size - n)
        starts = self.starts
        return self.joined[starts[off]:starts[off + n] - 1]


def code_prompt(rng: random.Random, corpus: Corpus, n_words: int) -> str:
    """A code-completion prompt: a docstring'd Python stub padded with context to about n_words."""
    fn = f"{rng.choice(CODE_NAMES)}_{rng.choice(CODE_NOUNS)}"
    arg = rng.choice(CODE_NOUNS)
    head = (
        "Complete the following Python function. Answer with one fenced code block.\n\n"
        "```python\n"
        f"def {fn}({arg}: list[dict], limit: int = {rng.randint(2, 512)}) -> dict:\n"
        f'    """'
    )
    tail = '"""\n    result = {}\n    for item in ' + arg + "[:limit]:\n"
    overhead = estimate_tokens(head) + estimate_tokens(tail)
    body = corpus.text(rng, max(4, n_words - overhead))
    return head + body + tail
