"""Extraction throughput vs a plain forward at the same batching (random Qwen3-8B-shaped target, H200).

Measures, over the same length-bucketed shards and batches (right padding, tokens_per_batch):
  plain forward    the full CausalLM forward without hooks (logits for every token), and the
                   decoder-only forward (all layers, no LM head) for reference;
  extraction       the extract stage's own loop (draftforge.extract.runner.run_rank): hooks on the 5
                   taps, stop after the last tap, gather valid tokens, device→host copy into pinned
                   buffers, streaming safetensors write + sha256 + done record to disk on writer
                   threads (--out-dir, default a temp dir under /tmp, removed afterwards);
  ceiling          a large bf16 torch.matmul (achieved TFLOP/s of the plain forward vs it).
Goal: extraction tokens/s ÷ plain-forward tokens/s ≥ 0.85.

    PYTHONPATH=src python benchmarks/extract_throughput.py          # CUDA, conf/target/qwen3-8b-random.yaml
    PYTHONPATH=src python benchmarks/extract_throughput.py --tiny   # CPU, seconds
Writes $OUT/extract_throughput.json when $OUT is set. Needs torch + transformers (+ PyYAML, installed
with transformers) and this repo on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from draftforge.extract.batching import make_batches, pad_batch  # noqa: E402
from draftforge.extract.config import ExtractConfig  # noqa: E402
from draftforge.extract.plan import ExtractPlan, ShardRows, ShardSpec, _cut  # noqa: E402
from draftforge.extract.runner import TargetView, run_rank  # noqa: E402
from draftforge.target.config import RandomTargetConfig  # noqa: E402
from draftforge.target.random import build_random_model  # noqa: E402


def target_spec(tiny: bool) -> tuple[RandomTargetConfig, list[int]]:
    import yaml

    conf = yaml.safe_load((REPO / "conf/target/qwen3-8b-random.yaml").read_text())
    if tiny:
        spec = RandomTargetConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=128,
                                  intermediate_size=256, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32)
        return spec, [1, 2, 3, 4, 5]
    return RandomTargetConfig(**conf["target"]["random"]), list(conf["target"]["drafter"]["target_layer_ids"])


def make_plan(n_tokens: int, min_len: int, max_len: int, tokens_per_shard: int, vocab: int, seed: int, on_load=None):
    """Synthetic sequences (uniform lengths) cut into length-sorted shards, as the stage plans them."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < n_tokens:
        lengths.append(int(rng.integers(min_len, max_len + 1)))
    lengths_np = np.asarray(lengths, dtype=np.int64)
    order = np.lexsort((np.arange(len(lengths)), -lengths_np))
    shards = [ShardSpec(i, "train", g, lengths_np[g]) for i, g in enumerate(_cut(order, lengths_np, tokens_per_shard, 1 << 30))]
    ids = {s.index: rng.integers(6, vocab, size=s.n_tokens).astype(np.int32) for s in shards}

    def load_rows(shard: ShardSpec) -> ShardRows:
        if on_load is not None:
            on_load(shard)
        offsets = np.concatenate([[0], np.cumsum(shard.lengths)]).astype(np.int64)
        return ShardRows(ids[shard.index], np.ones(shard.n_tokens, np.uint8), offsets)

    return ExtractPlan({}, shards, key="bench"), load_rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def plain_forward(model, plan: ExtractPlan, load_rows, tokens_per_batch: int, device, decoder_only: bool) -> dict:
    fwd = model.model if decoder_only else model
    tokens = padded = 0
    sync(device)
    t0 = time.perf_counter()
    for shard in plan.shards:
        rows = load_rows(shard)
        for b in make_batches(shard.lengths, tokens_per_batch, ExtractConfig.batch_fill):  # the stage's batches
            ids, mask, _ = pad_batch(rows.input_ids, rows.offsets, b, 0, device)
            out = fwd(input_ids=ids, attention_mask=mask, use_cache=False)
            del out
            tokens += b.n_tokens
            padded += ids.numel()
    sync(device)
    secs = time.perf_counter() - t0
    return {"tokens": tokens, "padded_tokens": padded, "seconds": secs, "tokens_per_s": tokens / secs}


def forward_flops(spec: RandomTargetConfig, plan: ExtractPlan, tokens_per_batch: int, lm_head: bool) -> float:
    """FLOPs the plain forward executes (padded batches): 2·params per token + causal attention."""
    h, hd = spec.hidden_size, spec.head_dim
    per_layer = h * spec.num_heads * hd * 2 + h * spec.num_kv_heads * hd * 2 + 3 * h * spec.intermediate_size
    flops = 0.0
    for shard in plan.shards:
        for b in make_batches(shard.lengths, tokens_per_batch, ExtractConfig.batch_fill):  # the stage's batches
            rows, t = b.stop - b.first, b.padded_len
            flops += 2 * per_layer * spec.num_layers * rows * t
            flops += spec.num_layers * rows * 2 * 2 * t * t * spec.num_heads * hd / 2  # QK^T + PV, causal half
            if lm_head:
                flops += 2 * h * spec.vocab_size * rows * t
    return flops


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (seconds)")
    ap.add_argument("--tokens", type=int, default=0, help="tokens to extract (default 262144; tiny 4096)")
    ap.add_argument("--tokens-per-batch", type=int, default=0, help="default 16384 (tiny 512)")
    ap.add_argument("--tokens-per-shard", type=int, default=0, help="default 65536 (tiny 1024)")
    ap.add_argument("--min-len", type=int, default=0, help="default 256 (tiny 16)")
    ap.add_argument("--max-len", type=int, default=0, help="default 2048 (tiny 128)")
    ap.add_argument("--storage-dtype", default="bfloat16", choices=["bfloat16", "float32", "float8_e4m3fn"])
    ap.add_argument("--writer-threads", type=int, default=2)
    ap.add_argument("--out-dir", default="", help="where shards are written (default: a temp dir in /tmp)")
    ap.add_argument("--keep-shards", action="store_true",
                    help="keep every shard (default: delete finished shards as the run goes, bounding disk use)")
    args = ap.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    if not args.tiny and tiny:
        print("no CUDA device: running --tiny", file=sys.stderr)
    device = torch.device("cpu") if tiny else torch.device("cuda", 0)
    dtype = torch.float32 if tiny else torch.bfloat16
    tokens = args.tokens or (2048 if tiny else 524288)
    tpb = args.tokens_per_batch or (512 if tiny else 16384)
    tps = args.tokens_per_shard or (1024 if tiny else 65536)
    min_len, max_len = args.min_len or (16 if tiny else 256), args.max_len or (128 if tiny else 2048)

    spec, taps = target_spec(tiny)
    t0 = time.perf_counter()
    with torch.device(device):
        model = build_random_model(spec, dtype=dtype)
    model.set_attn_implementation("eager" if tiny else "sdpa")
    build_s = time.perf_counter() - t0
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="extract-bench-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)

    def janitor(shard: ShardSpec) -> None:
        """Delete shards whose write has finished (done record present) to bound disk use."""
        if args.keep_shards:
            return
        for done in (root / "run").glob("shard-*.done.json"):
            done.with_name(done.name.replace(".done.json", ".safetensors")).unlink(missing_ok=True)
            done.unlink(missing_ok=True)

    plan, load_rows = make_plan(tokens, min_len, max_len, tps, spec.vocab_size, seed=0, on_load=janitor)
    warm_plan, warm_rows = make_plan(min(tokens, 2 * tpb), min_len, max_len, tps, spec.vocab_size, seed=1)
    target = TargetView(model, taps, spec.hidden_size, spec.vocab_size, 0, "random")

    def extract(p: ExtractPlan, rows, sub: str) -> dict:
        shard_dir = root / sub
        shutil.rmtree(shard_dir, ignore_errors=True)
        sync(device)
        t = time.perf_counter()
        st = run_rank(p, target, shard_dir, rank=0, world_size=1, storage_dtype=args.storage_dtype,
                      tokens_per_batch=tpb, max_seq_len=1 << 30, device=device, progress=False,
                      writer_threads=args.writer_threads, load_rows=rows)  # fmt: skip
        wall = time.perf_counter() - t
        # st.seconds: the shard loop incl. waiting for the last writes (what the stage logs); wall adds
        # the one-time setup (pinned host buffers).
        return {"tokens": st.tokens, "padded_tokens": st.padded_tokens, "seconds": st.seconds, "wall_s": wall,
                "tokens_per_s": st.tokens / st.seconds, "bytes_written": st.bytes_written}  # fmt: skip

    try:
        plain_forward(model, warm_plan, warm_rows, tpb, device, decoder_only=False)  # warm-up
        extract(warm_plan, warm_rows, "warm")
        plain = plain_forward(model, plan, load_rows, tpb, device, decoder_only=False)
        decoder = plain_forward(model, plan, load_rows, tpb, device, decoder_only=True)
        ext = extract(plan, load_rows, "run")
    finally:
        if not args.out_dir:
            shutil.rmtree(root, ignore_errors=True)
    ceiling = matmul_ceiling(device, dtype, 1024 if tiny else 8192, 5 if tiny else 50)
    flops_full = forward_flops(spec, plan, tpb, lm_head=True)
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "target": "tiny random Qwen3" if tiny else "random Qwen3-8B-shaped (conf/target/qwen3-8b-random.yaml)",
        "dtype": str(dtype).removeprefix("torch."), "storage_dtype": args.storage_dtype, "taps": taps,
        "tokens": plan.shards and sum(s.n_tokens for s in plan.shards), "n_shards": len(plan.shards),
        "tokens_per_batch": tpb, "tokens_per_shard": tps, "lengths": [min_len, max_len],
        "padding_efficiency": round(plain["tokens"] / plain["padded_tokens"], 4),
        "model_build_s": round(build_s, 1),
        "plain_forward": plain, "decoder_forward": decoder, "extraction": ext,
        "ratio_vs_plain_forward": ext["tokens_per_s"] / plain["tokens_per_s"],
        "ratio_vs_decoder_forward": ext["tokens_per_s"] / decoder["tokens_per_s"],
        "plain_forward_tflops": flops_full / plain["seconds"] / 1e12,
        "matmul_ceiling_tflops": ceiling / 1e12,
        "plain_forward_mfu_vs_ceiling": flops_full / plain["seconds"] / ceiling,
        "extract_write_gib_per_s": ext["bytes_written"] / ext["seconds"] / 2**30,
    }  # fmt: skip
    print(f"{'measure':<34}{'value':>14}")
    for name, value in [
        ("plain forward tokens/s", plain["tokens_per_s"]), ("decoder-only forward tokens/s", decoder["tokens_per_s"]),
        ("extraction tokens/s (incl. writes)", ext["tokens_per_s"]),
        ("extraction / plain forward", result["ratio_vs_plain_forward"]),
        ("extraction / decoder-only forward", result["ratio_vs_decoder_forward"]),
        ("plain forward TFLOP/s", result["plain_forward_tflops"]), ("bf16 matmul ceiling TFLOP/s" if not tiny else
        "matmul ceiling TFLOP/s", result["matmul_ceiling_tflops"]),
        ("plain forward / ceiling", result["plain_forward_mfu_vs_ceiling"]),
        ("shard write GiB/s", result["extract_write_gib_per_s"]), ("padding efficiency", result["padding_efficiency"]),
    ]:  # fmt: skip
        print(f"{name:<34}{value:>14.3f}")
    write_record("extract_throughput", result)


if __name__ == "__main__":
    main()
