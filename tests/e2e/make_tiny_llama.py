"""Make a tiny random-weight Llama for the end-to-end tests: no hub, no download, ~1.4 MB.

    python make_tiny_llama.py OUT_DIR

Run with the vLLM virtualenv's Python (it needs ``torch``, ``transformers`` and ``tokenizers``).
Deterministic: the same script and library versions give the same files.

- Tokenizer: byte-level BPE trained here on a small built-in corpus — the common English words
  soakd's synthetic prompts are made of (parsed from the repository's ``soakd/workload/corpus.py``,
  so each ``" word"`` is one token, as in real BPE vocabularies and soakd's length estimate), a
  paragraph of prose and some Python: ~1,250 tokens (the corpus runs out of merges before
  VOCAB_SIZE). Special tokens and a small chat template
  (``<|user|>`` … ``<|end|>``) so ``/v1/chat/completions`` works.
- Model: ``LlamaForCausalLM``, 2 layers, hidden 128, 4 heads (head dim 32), intermediate 256,
  untied embeddings (tied ones make greedy decoding repeat the last token forever: its own logit
  wins), ``max_position_embeddings`` 4096, random weights from seed 0, saved as bfloat16 safetensors.

Its output is random text: whole tokens at random, byte-level pieces that do not form UTF-8
(U+FFFD after decoding), EOS at random — callers set ``ignore_eos`` and turn soakd's U+FFFD
check off for it.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SEED = 0
VOCAB_SIZE = 2048
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ content }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

PROSE = """
A soak test runs an inference server under realistic mixed load for many hours and watches
whether it stays fast and healthy. Latency, throughput, memory and the key-value cache are
recorded continuously, and every window is compared with the baseline. The quick brown fox
jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 17 19 23 29 31 37 100 512 2048.
Please answer the question below in one short paragraph. List the first twelve prime numbers,
separated by commas, and then name the planet closest to the sun. Mercury is the planet closest
to the sun. User: hello! Assistant: hello, how can I help you today? Thank you.
"""

CODE = '''
def parse_items(items: list[dict], limit: int = 16) -> dict:
    """Complete the following Python function. Answer with one fenced code block."""
    result = {}
    for item in items[:limit]:
        key = item.get("key")
        if key is None:
            continue
        result[key] = result.get(key, 0) + 1
    return result


class Window:
    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"Window({self.start!r}, {self.end!r})"
'''


def soakd_words() -> list[str]:
    """WORDS, CODE_NAMES and CODE_NOUNS of soakd/workload/corpus.py (parsed, not imported: the vLLM
    virtualenv has no soakd)."""
    path = Path(__file__).resolve().parents[2] / "soakd" / "workload" / "corpus.py"
    words: list[str] = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("WORDS", "CODE_NAMES", "CODE_NOUNS"):
                call = node.value
                assert isinstance(call, ast.Call)
                src = call.args[0]
                # """...""".split()
                assert isinstance(src, ast.Call) and isinstance(src.func, ast.Attribute)
                assert isinstance(src.func.value, ast.Constant)
                words.extend(src.func.value.value.split())
    if not words:
        raise SystemExit(f"no word lists found in {path}")
    return words


def training_corpus() -> list[str]:
    words = soakd_words()
    # Each word many times with its leading space (as in prompts), in a fixed order.
    lines = []
    for rep in range(8):
        rotated = words[rep * 7 % len(words):] + words[: rep * 7 % len(words)]
        lines.extend(" " + " ".join(rotated[i:i + 16]) for i in range(0, len(rotated), 16))
    return lines + PROSE.strip().splitlines() * 4 + CODE.strip("\n").splitlines() * 4


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(training_corpus(), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=SPECIAL[4:], model_max_length=4096, clean_up_tokenization_spaces=False,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    vocab = len(fast)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=fast.convert_tokens_to_ids("<s>"), eos_token_id=fast.convert_tokens_to_ids("</s>"),
        pad_token_id=fast.convert_tokens_to_ids("<pad>"), torch_dtype="bfloat16",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # generation_config.json: no sampling defaults of its own (vLLM would apply them)
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        for k in ("temperature", "top_p", "top_k", "do_sample"):
            data.pop(k, None)
        gen.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"tiny llama: vocab {vocab}, {sum(p.numel() for p in model.parameters())} parameters, {size} bytes in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
