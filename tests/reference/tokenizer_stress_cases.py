#!/usr/bin/env python3
"""Writes tokenizer_stress_cases.json: random texts over code points where regex engines and
normalisers tend to disagree (Unicode whitespace such as U+0085 and U+FEFF, combining marks,
Hangul jamo, case-insensitive contractions, other scripts' digits, emoji sequences, unassigned and
private-use code points, pieces of special tokens). tokenizer_ref.py --cases turns it into
fixtures/tokenizer_qwen3_stress.json with transformers. Fixed seed: rerunning gives the same file."""
import json
import os
import random

POOL = [
    "a", "Z", "the", " ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\xa0", "\u1680",
    "\u180e", "\u2000", "\u200a", "\u200b", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
    "\ufeff", "'s", "'S", "'LL", "'ll", "'\u017f", "'Re", "'d", "\u01c5", "\u0301", "e\u0301",
    "\u1100\u1161", "\u11a8", "\u0661\u0662", "\u0966", "\u00b2", "\u2167", "12", "3.5", "\u4e2d",
    "\u6587", "\u3042", "\u30ab", "\ud55c", "\U0001f44d", "\U0001f3fd", "\u200d", "\ufe0f",
    "\U0001f1e9\U0001f1ea", "\U0001d538", "\U00013000", "\u0378", "\ue000", "\U000f0000", "\uffff",
    "<|im_", "|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think", "...", "!!", "->", "$",
    "\u00e9", "\u00df", "\u0130", "\u0131", "\u03a3", "\u0444", "\u05d0", "\u0627", "\u0e01",
    "\u0915\u094d", "\u2764", "\u2764\ufe0f", "\\", "\"", "{", "}", "\x00", "\x1b", "\x7f",
]


def main():
    rng = random.Random(20261122)
    texts = []
    for i in range(160):
        n = rng.randint(1, 30)
        texts.append({"name": f"stress_{i:03d}", "text": "".join(rng.choice(POOL) for _ in range(n))})
    out = {"comment": "Written by tokenizer_stress_cases.py (fixed seed); do not edit.",
           "texts": texts, "chats": []}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer_stress_cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, indent=0)
        f.write("\n")
    print(f"wrote {path}: {len(texts)} texts")


if __name__ == "__main__":
    main()
