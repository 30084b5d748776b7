#!/usr/bin/env python3
"""Write a tiny random-weight llama-architecture GGUF for llama.cpp's ``llama-server``.

Deterministic (fixed seed; the same bytes on every run with the same ``gguf`` version) and small
(about 1 MB): 2 layers, 64-dim embeddings, 4 heads, a 16k training context, all f32.

The vocabulary is a SentencePiece ("llama") one, built so that soakd's synthetic prompts
tokenize to about one token per word, as with a real model's tokenizer:

  <unk> <s> </s> <|im_start|> <|im_end|>   control tokens (ChatML chat template)
  <0x00> ... <0xFF>                         byte-fallback tokens: any text tokenizes
  ▁ and printable ASCII                     single characters
  ▁w, ▁wo, ▁wor, ▁word                      every word of soakd's prompt corpus with all its
                                            ▁-prefixes (SPM merges pairs only into tokens that
                                            exist, so a word is reached through its prefixes)

The output projection gives non-zero logits only to whole words (zero rows elsewhere), so with
llama-server's default top-k (40) the model emits English words, never bytes, control tokens or
end-of-sequence: valid UTF-8, no U+FFFD, outputs as long as ``max_tokens``. Logits have a
standard deviation of about 1, so even at temperature 0.2 the output varies (no degenerate
repetition).

Run with a Python that has the ``gguf`` package (tests/e2e/prepare_llamacpp.py makes a small
venv for it):  python make_tiny_gguf.py --out tiny.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType

SEED = 20240611
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 4
N_LAYER = 2
N_FF = 192
N_CTX_TRAIN = 16384
LOGIT_STD = 1.0

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "soakd" / "workload" / "corpus.py"
# words of the code_completion stub around the corpus words
CODE_WORDS = """def return for in if else not None True False self list dict str int float import from
    Complete the following Python function Answer with one fenced code block Args Returns
    result value item items data""".split()


def corpus_words() -> list[str]:
    """soakd's own prompt words, read from soakd/workload/corpus.py (stdlib only, not the package)."""
    spec = importlib.util.spec_from_file_location("_soakd_corpus", CORPUS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    words = list(mod.WORDS) + list(mod.CODE_NAMES) + list(mod.CODE_NOUNS) + CODE_WORDS
    out: list[str] = []
    seen: set[str] = set()
    for w in words:
        for part in w.replace("_", " ").split():
            if part not in seen:
                seen.add(part)
                out.append(part)
    return out


def build_vocab() -> tuple[list[str], list[float], list[int], set[int], dict[str, int]]:
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    index: dict[str, int] = {}

    def add(text: str, score: float, ttype: int) -> int:
        if text in index:
            return index[text]
        index[text] = len(tokens)
        tokens.append(text)
        scores.append(score)
        types.append(int(ttype))
        return index[text]

    add("<unk>", 0.0, TokenType.UNKNOWN)
    add("<s>", 0.0, TokenType.CONTROL)
    add("</s>", 0.0, TokenType.CONTROL)
    add("<|im_start|>", 0.0, TokenType.CONTROL)
    add("<|im_end|>", 0.0, TokenType.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, TokenType.BYTE)
    add("\u2581", -1.0, TokenType.NORMAL)
    for c in range(0x21, 0x7F):
        add(chr(c), -1.0, TokenType.NORMAL)
    words: set[int] = set()
    for w in corpus_words():
        piece = "\u2581" + w
        for n in range(2, len(piece) + 1):
            # longer pieces score higher: merges grow a word left to right
            tid = add(piece[:n], float(n), TokenType.NORMAL)
            if n == len(piece):
                words.add(tid)
    return tokens, scores, types, words, index


def write(out: Path) -> str:
    tokens, scores, types, words, index = build_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(SEED)
    head_dim = N_EMBD // N_HEAD

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tmp = out.with_suffix(".tmp")
    w = GGUFWriter(str(tmp), "llama")
    w.add_name("soakd-tiny-llama")
    w.add_file_type(LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(index["<unk>"])
    w.add_bos_token_id(index["<s>"])
    w.add_eos_token_id(index["<|im_end|>"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)

    # numpy shapes are GGML's ne reversed: (rows = outputs, cols = inputs)
    w.add_tensor("token_embd.weight", normal((n_vocab, N_EMBD), 1.0))
    for i in range(N_LAYER):
        std = 1.0 / np.sqrt(N_EMBD)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", normal((N_HEAD * head_dim, N_EMBD), std))
        w.add_tensor(f"blk.{i}.attn_k.weight", normal((N_HEAD_KV * head_dim, N_EMBD), std))
        w.add_tensor(f"blk.{i}.attn_v.weight", normal((N_HEAD_KV * head_dim, N_EMBD), std))
        w.add_tensor(f"blk.{i}.attn_output.weight", normal((N_EMBD, N_HEAD * head_dim), std))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", normal((N_FF, N_EMBD), std))
        w.add_tensor(f"blk.{i}.ffn_up.weight", normal((N_FF, N_EMBD), std))
        w.add_tensor(f"blk.{i}.ffn_down.weight", normal((N_EMBD, N_FF), 1.0 / np.sqrt(N_FF)))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    # after the RMS norm the hidden state has unit RMS: logit std = row std * sqrt(N_EMBD)
    output = normal((n_vocab, N_EMBD), LOGIT_STD / np.sqrt(N_EMBD))
    mask = np.zeros((n_vocab, 1), dtype=np.float32)
    mask[sorted(words)] = 1.0
    w.add_tensor("output.weight", output * mask)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    print(f"wrote {out}: {n_vocab} tokens ({len(words)} emitted words), {out.stat().st_size} bytes, "
          f"sha256 {digest}")
    return digest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
