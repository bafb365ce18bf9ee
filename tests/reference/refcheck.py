"""What the GPU-machine reference checks share (hf_export_check.py, lora_peft_check.py): running
a C++ program of the build inside the runtime kit, and loading a Hugging Face directory in
transformers (eager attention) across the 4.x and 5.x keyword for the dtype."""
import os
import subprocess

from transformers import AutoModelForCausalLM


def run_cpp(kit, cmd):
    """Runs cmd (a C++ program of the build) after `source KIT/kit-env.sh` ('' = no kit); returns
    its stdout, or exits with its output when it fails."""
    env = dict(os.environ, KIT=kit, OPENBLAS_NUM_THREADS="4")
    script = 'source "$KIT/kit-env.sh" && exec "$@"' if kit else 'exec "$@"'
    res = subprocess.run(["bash", "-c", script, "_"] + cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stdout + res.stderr)
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {res.returncode}")
    return res.stdout


def load_hf(path, dtype, device):
    """(model on `device` in eval mode, loading info: missing/unexpected keys)."""
    kw = dict(attn_implementation="eager", output_loading_info=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except TypeError:  # transformers 4.x
        model, info = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, **kw)
    return model.to(device).eval(), info
