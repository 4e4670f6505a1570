"""HF batched greedy generate on a random-weight model of the target's shape (fp32, the curate regeneration
path's call): prefill and per-step cost at a few batch sizes and KV lengths -> probe.json."""

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig.from_dict(json.load(open(sys.argv[1])))
torch.manual_seed(0)
t0 = time.time()
model = LlamaForCausalLM(cfg).to("cuda", torch.float32).eval()
print("model on GPU %.1fs" % (time.time() - t0), flush=True)


def gen(B, L, N):
    ids = torch.randint(100, 40000, (B, L), device="cuda")
    att = torch.ones_like(ids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=att, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                       eos_token_id=[2], pad_token_id=2)
    torch.cuda.synchronize()
    return time.perf_counter() - t


gen(64, 32, 4)  # warm-up
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "points": []}
N = 40
for B, L in [(512, 256), (1024, 128), (1024, 384), (2048, 256)]:
    t1 = gen(B, L, 1)
    tn = gen(B, L, N)
    step = (tn - t1) / (N - 1)
    out["points"].append({"B": B, "L": L, "prefill_s": t1, "step_s": step, "kv_mid": L + N / 2})
    print(f"B {B} L {L}: prefill {t1*1e3:.0f} ms, step {step*1e3:.1f} ms", flush=True)
    torch.cuda.empty_cache()
out["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps(out))
