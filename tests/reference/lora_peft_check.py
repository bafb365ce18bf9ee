#!/usr/bin/env python3
"""GPU-machine check of qtrain's LoRA against peft (docs/finetune.md, LoRA).

For tiny Qwen3 models (tied and untied embeddings, GQA, several target sets and alphas) and a tiny
Qwen3-MoE (attention adapters, and adapters on every expert: lora.targets experts.gate_up_proj,
experts.down_proj, which peft loads as target_parameters through lora.ParamWrapper; routers and
experts frozen):
  1. qtrain trains the whole model two steps from a wide initialisation and `qtrain export`s it:
     the base, a Hugging Face directory (bf16 values, exact in fp32);
  2. a qtrain LoRA run on that base (`[model] init`, `[lora]` r, alpha, dropout, targets) trains
     the adapters a few steps, with dropout, and writes a checkpoint;
  3. `qtrain export` writes the adapter directory (adapter_model.safetensors + adapter_config.json)
     and `qtrain export --merge` the merged model;
  4. our CPU engine writes its fp32 logits of the LoRA model (qtrain_hf_tool lora-logits: base +
     adapters, dropout off) for a fixed batch of token ids;
  5. peft loads base + adapter directory (PeftModel.from_pretrained, fp32, eager attention, on the
     CPU and on the GPU when there is one): every lora_A/lora_B of the file is loaded into the
     model unchanged and no other parameter of the base changed, its trainable parameter count
     (is_trainable=True) is ours and get_peft_model's with the same LoraConfig, and its logits
     and loss match ours (relative Frobenius error; fp32 <= 1e-5 on the CPU, 1e-4 on the GPU);
  6. peft's merge_and_unload() of that model gives our logits within fp32 (1e-5 / 1e-4), and
     transformers loading our --merge directory (bf16 weights) gives them within bf16 (3e-2);
     our merged weights equal peft's merged weights rounded to bf16 (all but a few rounding ties;
     a Qwen3-MoE file's per-expert gate_proj / up_proj / down_proj against the rows of peft's
     merged fused experts.gate_up_proj / experts.down_proj);
  7. with expert adapters: peft's own get_peft_model with the same LoraConfig (target_parameters)
     has exactly our file's tensor names and shapes (the nesting of its ParamWrappers included).
Exits 1 if any check fails.

Run on the GPU machine from the repository root, with the binaries built here and the runtime kit
(docs/cuda.md): the C++ programs run inside `source .kit/kit-env.sh`, python outside it.
  python3 tests/reference/lora_peft_check.py --build build --kit .kit --work /tmp/loracheck
Needs torch, transformers, peft, safetensors and numpy.
"""
import argparse
import json
import os
import re
import shutil
import sys

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refcheck import load_hf, run_cpp  # noqa: E402

MODELS = [  # name, [model] keys of the base
    ("tied_gqa2", dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                       tie_word_embeddings="true", num_heads=4, num_kv_heads=2, head_dim=16)),
    ("untied_gqa4_hd64", dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3,
                              tie_word_embeddings="false", num_heads=4, num_kv_heads=1, head_dim=64)),
    # Qwen3-MoE (issue 18): layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; adapters on
    # the attention projections and on every expert (not on the dense MLP, docs/finetune.md).
    ("moe_e4_k2", dict(vocab_size=112, hidden_size=32, intermediate_size=48, num_layers=3,
                       tie_word_embeddings="false", num_heads=4, num_kv_heads=2, head_dim=16,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       norm_topk_prob="true", mlp_only_layers="1")),
]
MOE_LORAS = ("qv_alpha_odd", "attn_default", "experts", "experts_down")  # a Qwen3-MoE base's
EXPERT_LORAS = ("experts", "experts_down")  # only a Qwen3-MoE base takes these
LORAS = [  # name, [lora] keys
    ("all_linear", dict(r=4, alpha=8, dropout=0.1, targets="all-linear")),
    ("qv_alpha_odd", dict(r=3, alpha=5.5, dropout=0.0, targets="q_proj,v_proj")),
    ("attn_default", dict(r=8, alpha=16, dropout=0.05, targets="q_proj,k_proj,v_proj,o_proj")),
    ("mlp", dict(r=2, alpha=2, dropout=0.2, targets="gate_proj,up_proj,down_proj")),
    # Every expert's gate_up_proj and down_proj (peft's target_parameters; no dropout there).
    ("experts", dict(r=3, alpha=6, dropout=0.0,
                     targets="q_proj,v_proj,experts.gate_up_proj,experts.down_proj")),
    ("experts_down", dict(r=2, alpha=3, dropout=0.0, targets="experts.down_proj")),
]
FAILURES = []


def check(ok, what):
    print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def write_deck(path, sections):
    with open(path, "w") as f:
        for sec, keys in sections.items():
            f.write(f"[{sec}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))


def from_pretrained(path, device):
    return load_hf(path, torch.float32, device)[0]


def logits_of(model, ids, device):
    with torch.no_grad():
        t = torch.from_numpy(ids).to(device)
        out = model(input_ids=t, labels=t)
    return out.logits.float().cpu().numpy(), float(out.loss)


def train_base(a, name, keys):
    ck = os.path.join(a.work, name + "_base_ck")
    deck = os.path.join(a.work, name + "_base.ini")
    write_deck(deck, {
        "model": dict(keys, initializer_range=0.2, rope_theta=10000),
        "train": dict(seq_len=16, micro_batch=2, global_batch=2, steps=2, seed=11),
        "optim": dict(lr=0.02, warmup_steps=0),
        "data": dict(source="synthetic"),
        "checkpoint": dict(dir=ck, resume="none"),
        "log": dict(metrics=""),
    })
    run_cpp(a.kit, [a.qtrain, deck])
    base = os.path.join(a.work, name + "_base")
    print("  " + run_cpp(a.kit, [a.qtrain, "export", os.path.join(ck, "step_00000002.h5"), base]).strip())
    return base


def train_lora(a, name, base, lora):
    ck = os.path.join(a.work, name + "_ck")
    deck = os.path.join(a.work, name + ".ini")
    write_deck(deck, {
        "model": dict(init=base),
        "train": dict(seq_len=16, micro_batch=2, global_batch=4, steps=6, seed=5),
        "optim": dict(lr=0.05, warmup_steps=0, weight_decay=0.01),
        "lora": lora,
        "data": dict(source="synthetic"),
        "checkpoint": dict(dir=ck, resume="none"),
        "log": dict(metrics=""),
    })
    out = run_cpp(a.kit, [a.qtrain, deck])
    m = re.search(r"^lora: .*: (\d+) trainable parameters", out, re.M)
    return os.path.join(ck, "step_00000006.h5"), int(m.group(1)) if m else -1


def check_lora(a, name, base, lora, ids):
    ckpt, ours_trainable = train_lora(a, name, base, lora)
    adapter = os.path.join(a.work, name + "_adapter")
    merged = os.path.join(a.work, name + "_merged")
    print("  " + run_cpp(a.kit, [a.qtrain, "export", ckpt, adapter]).strip())
    print("  " + run_cpp(a.kit, [a.qtrain, "export", "--merge", ckpt, merged]).strip())
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    check(cfg["peft_type"] == "LORA" and cfg["r"] == lora["r"] and cfg["lora_alpha"] == lora["alpha"]
          and cfg["lora_dropout"] == lora["dropout"] and cfg["base_model_name_or_path"] == base,
          f"{name}: adapter_config.json {cfg}")
    ids_file = os.path.join(a.work, name + ".ids.safetensors")
    save_file({"input_ids": ids}, ids_file)
    out_file = os.path.join(a.work, name + ".ours.safetensors")
    run_cpp(a.kit, [a.tool, "lora-logits", ckpt, ids_file, out_file])
    r = load_file(out_file)
    ref, ref_loss = r["logits"], float(r["loss"])
    stored = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    check(any(np.any(v != 0) for k, v in stored.items() if "lora_B" in k), f"{name}: trained B != 0")

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        tol = 1e-5 if device == "cpu" else 1e-4
        tag = f"{name} {device}"
        base_model = from_pretrained(base, device)
        base_sd = {k: v.detach().cpu().clone() for k, v in base_model.state_dict().items()}
        model = PeftModel.from_pretrained(base_model, adapter).to(device).eval()
        # Every adapter tensor of the file is in the model, unchanged; nothing else moved.
        loaded = {}
        for k, v in model.state_dict().items():
            if "lora_" in k:
                loaded[k.replace(".default", "")] = v.detach().cpu().numpy()
        check(set(loaded) == set(stored), f"{tag}: peft's lora tensors are exactly the file's "
                                          f"({len(loaded)} vs {len(stored)})")
        check(all(np.array_equal(loaded[k], stored[k]) for k in stored if k in loaded),
              f"{tag}: adapter values loaded bit for bit")
        def base_name(k):  # base_model.model.X.q_proj.base_layer.weight -> X.q_proj.weight
            return k.replace("base_model.model.", "", 1).replace(".base_layer", "")
        unchanged = all(torch.equal(v.detach().cpu(), base_sd[base_name(k)])
                        for k, v in model.state_dict().items() if "lora_" not in k)
        check(unchanged, f"{tag}: base weights untouched by peft")
        logits, loss = logits_of(model, ids, device)
        e = rel_err(logits, ref)
        check(e <= tol, f"{tag}: peft logits rel err {e:.2e} (tol {tol:.0e}), loss {loss:.6f} vs ours {ref_loss:.6f}")
        check(abs(loss - ref_loss) <= 10 * tol * abs(ref_loss), f"{tag}: loss")

        mm = model.merge_and_unload()
        mlogits, _ = logits_of(mm, ids, device)
        e = rel_err(mlogits, ref)
        check(e <= tol, f"{tag}: peft merge_and_unload logits rel err {e:.2e} (tol {tol:.0e})")
        if device == "cpu":
            peft_sd = {k: v.detach().cpu() for k, v in mm.state_dict().items()}
            diff = total = 0
            # A Qwen3-MoE file names each expert's projections (experts.{e}.gate_proj.weight),
            # which transformers 5 holds fused (experts.gate_up_proj [E, 2 Im, H], gate rows
            # first; experts.down_proj [E, H, Im]): compared with the rows of peft's merge.
            per_expert = []
            for k, v in load_torch(os.path.join(merged, "model.safetensors")).items():  # bf16
                m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", k)
                if k not in peft_sd and m:
                    per_expert.append(k)
                    e, which = int(m.group(2)), m.group(3)
                    if which == "down":
                        want = peft_sd[m.group(1) + ".down_proj"][e]
                    else:
                        gu = peft_sd[m.group(1) + ".gate_up_proj"][e]
                        im = gu.shape[0] // 2
                        want = gu[:im] if which == "gate" else gu[im:]
                    want = want.to(torch.bfloat16)
                else:
                    want = peft_sd[k].to(torch.bfloat16)
                diff += int((v != want).sum())
                total += v.numel()
            check(diff <= max(10, total // 10000),
                  f"{tag}: our --merge weights = peft's merge rounded to bf16 ({diff} of {total} differ)")
            check(not per_expert or "num_experts" in json.load(open(os.path.join(base, "config.json"))),
                  f"{tag}: per-expert names only in a Qwen3-MoE file ({len(per_expert)} skipped)")
        del model, mm
        merged_model = from_pretrained(merged, device)
        glogits, _ = logits_of(merged_model, ids, device)
        e = rel_err(glogits, ref)
        check(e <= 3e-2, f"{tag}: transformers on our --merge (bf16 weights) logits rel err {e:.2e} (tol 3e-2)")
        del merged_model

    # Trainable parameters: ours = peft's, loaded for training and made fresh by get_peft_model.
    trainable = PeftModel.from_pretrained(from_pretrained(base, "cpu"), adapter, is_trainable=True)
    n_loaded = trainable.get_nb_trainable_parameters()[0]
    targets = cfg["target_modules"]
    params = cfg.get("target_parameters")
    check(bool(params) == ("experts." in lora["targets"]),
          f"{name}: adapter_config.json target_parameters {params}")
    fresh = get_peft_model(from_pretrained(base, "cpu"),
                           LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                      target_modules=targets, target_parameters=params,
                                      task_type="CAUSAL_LM"))
    n_fresh = fresh.get_nb_trainable_parameters()[0]
    check(ours_trainable == n_loaded == n_fresh,
          f"{name}: trainable parameters ours {ours_trainable}, peft loaded {n_loaded}, get_peft_model {n_fresh}")
    if params:  # peft's own names and shapes for this LoraConfig are exactly the file's
        from peft import get_peft_model_state_dict
        theirs = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(fresh).items()}
        ours = {k: tuple(v.shape) for k, v in stored.items()}
        check(theirs == ours, f"{name}: peft's get_peft_model tensors = the file's: "
                              f"{sorted(set(theirs) ^ set(ours)) or 'same names'}, "
                              f"{[(k, ours[k], theirs[k]) for k in ours if k in theirs and ours[k] != theirs[k]]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="build directory with bin/qtrain and bin/qtrain_hf_tool")
    ap.add_argument("--kit", default=".kit", help="runtime kit for the C++ programs ('' = none)")
    ap.add_argument("--work", default="/tmp/qtrain-lora-check")
    ap.add_argument("--models", default="", help="comma-separated base names to check (default: all)")
    a = ap.parse_args()
    a.qtrain = os.path.abspath(os.path.join(a.build, "bin", "qtrain"))
    a.tool = os.path.abspath(os.path.join(a.build, "bin", "qtrain_hf_tool"))
    a.kit = os.path.abspath(a.kit) if a.kit else ""
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}, "
          f"cuda {torch.cuda.is_available()}")
    rng = np.random.default_rng(20261123)
    only = set(filter(None, a.models.split(",")))
    for mname, keys in MODELS:
        if only and mname not in only:
            continue
        print(f"{mname}:")
        base = train_base(a, mname, keys)
        for lname, lora in LORAS:
            moe = "num_experts" in keys
            if (moe and lname not in MOE_LORAS) or (not moe and lname in EXPERT_LORAS):
                continue
            ids = rng.integers(0, keys["vocab_size"], size=(2, 24), dtype=np.int64)
            check_lora(a, f"{mname}_{lname}", base, lora, ids)
    print("PASS: all checks passed" if not FAILURES else f"FAIL: {len(FAILURES)} check(s) failed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
