#!/usr/bin/env python3
"""transformers generation baseline for `qtrain generate --device cuda` (same GPU, same run).

Writes a Qwen3 of a --model preset with random weights (seed 0, bf16) as a Hugging Face directory
(--save DIR, once; `qtrain generate DIR` reads the same weights), then times greedy generation of
transformers on it: bf16, SDPA attention, the dynamic key/value cache, batch 1, the prompt text
tokenized by the tokenizer in --tokenizer DIR, end-of-sequence ignored. Prints one JSON line:

  prefill tokens/s = prompt tokens / time of generate(max_new_tokens=1)
  decode tokens/s  = (N - 1) / (time of generate(max_new_tokens=N) - time of max_new_tokens=1)

each time the median of --runs after a warm-up run, as qtrain's stderr line counts them (the new
tokens after the first, from the end of the prefill).

  python3 bench/baselines/hf_generate.py --model qwen3-0.6b --save /tmp/q06 --tokenizer TOK \
      --prompt-file P.txt --new-tokens 256
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from hf_train import PRESETS, qwen3_config


def timed_generate(model, ids, n, runs):
    """Median seconds of `runs` greedy generations of n new tokens (after one warm-up)."""
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
              pad_token_id=0, use_cache=True)
    model.generate(ids, **kw)
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert out.shape[1] == ids.shape[1] + n, out.shape
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the layer count")
    ap.add_argument("--save", required=True, help="Hugging Face directory of the weights (written once)")
    ap.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()

    cfg, _ = qwen3_config(a)
    cfg.use_cache = True
    if not os.path.exists(os.path.join(a.save, "config.json")):
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(a.save)
    model = Qwen3ForCausalLM.from_pretrained(a.save, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.tokenizer, "tokenizer.json"))
    with open(a.prompt_file, encoding="utf-8") as f:
        ids = torch.tensor([tok.encode(f.read())], device="cuda")
    with torch.inference_mode():
        t1 = timed_generate(model, ids, 1, a.runs)
        tn = timed_generate(model, ids, a.new_tokens, a.runs)
    print(json.dumps({
        "baseline": "transformers eager, SDPA, dynamic cache", "model": a.model, "layers": cfg.num_hidden_layers,
        "prompt_tokens": ids.shape[1], "new_tokens": a.new_tokens,
        "prefill_tokens_per_s": round(ids.shape[1] / t1, 1),
        "decode_tokens_per_s": round((a.new_tokens - 1) / (tn - t1), 1),
        "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
