"""What a CPU decode step pays besides its weight products: each probe timed as is and with every routed product
stubbed (a preallocated output of the right shape, no weight read), so the second number is the step's element-wise,
attention, cache and Python cost alone.

Probes (SmolLM2-135M's shape with random weights, the default drafter's shape, `benchmarks/cpu_roofline.py`'s
builders): the AR step (verify 1), verify(n) for a tree of n nodes, and the drafter's block pass. Each is timed
`--turns` times, the real and the stubbed form alternating, and the minimum of each kept: the products' memory
traffic makes the real form noisy on a shared host, the stubbed form much less.

    PYTHONPATH=src python benchmarks/cpu_step_overhead.py                # ~1 min on 2 cores
    PYTHONPATH=src python benchmarks/cpu_step_overhead.py --tiny         # seconds (a smoke run)
    PYTHONPATH=src python benchmarks/cpu_step_overhead.py --compare-attention  # + the same probes on SDPA alone
    PYTHONPATH=src python benchmarks/cpu_step_overhead.py --compare-layer-ops  # + norms/SwiGLU/rotary on torch's ops
Writes $OUT/cpu_step_overhead.json when $OUT is set. To compare two commits, run it from each checkout in turn
(the same machine, nothing else running) and compare the stubbed column.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _out import write_record  # noqa: E402
from cpu_roofline import _git_sha, build, draft_probe, timed, verify_probe, with_draft_vocab  # noqa: E402

from draftforge.engine import blocks, cpu_linear, layer_ops  # noqa: E402


class StubbedProducts:
    """Within the block, every routed product returns a preallocated (rows, N) tensor: no weight is read."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.real: Callable[..., torch.Tensor] = cpu_linear.run_route

    def _stub(self, route: str, x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = (x2.shape[0], w.shape[0])
        if key not in self.outputs:
            self.outputs[key] = torch.zeros(key)
        return self.outputs[key]

    def __enter__(self) -> StubbedProducts:
        cpu_linear.run_route = self._stub
        return self

    def __exit__(self, *exc: Any) -> None:
        cpu_linear.run_route = self.real


def measure(probe: Callable[[], None], turns: int, reps: int, compare_attention: bool = False,
            compare_layer_ops: bool = False) -> dict[str, float]:
    """min ms of `probe` over `turns` turns of `reps` calls each, real and stubbed alternating (with
    `compare_attention`, each also with every attention on SDPA: `blocks.KERNEL_ATTENTION_ROWS` = 0; with
    `compare_layer_ops`, each also with the layers' element-wise work on torch's ops: `layer_ops.ENABLED` = False)."""
    rows = blocks.KERNEL_ATTENTION_ROWS
    ways = {"": (rows, True)} | ({"sdpa_": (0, True)} if compare_attention else {}) \
        | ({"torch_ops_": (rows, False)} if compare_layer_ops else {})
    times: dict[str, list[float]] = {}
    try:
        for _ in range(turns):
            for tag, (blocks.KERNEL_ATTENTION_ROWS, layer_ops.ENABLED) in ways.items():
                times.setdefault(tag + "ms", []).append(timed(probe, reps, 1))
                with StubbedProducts():
                    times.setdefault(tag + "stubbed_ms", []).append(timed(probe, reps, 1))
    finally:
        blocks.KERNEL_ATTENTION_ROWS, layer_ops.ENABLED = rows, True
    out = {k: 1e3 * min(v) for k, v in times.items()}
    out["products_ms"] = out["ms"] - out["stubbed_ms"]
    out["other_share"] = out["stubbed_ms"] / out["ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,13", help="verify sizes (1 = the AR step)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the drafter's draft vocabulary (0: the whole one)")
    ap.add_argument("--compare-attention", action="store_true",
                    help="also time each probe with every attention on SDPA (no decode-attention kernel), alternating")
    ap.add_argument("--compare-layer-ops", action="store_true",
                    help="also time each probe with the layers' norms, SwiGLU and rotary on torch's ops, alternating")
    args = ap.parse_args()
    if args.tiny:
        args.prompt_len, args.turns, args.reps = 40, 2, 2
    tm, d = build(args.tiny)
    if args.draft_vocab and not args.tiny:
        d = with_draft_vocab(d, tm, args.draft_vocab)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, tm.vocab_size, (args.prompt_len,), generator=g).tolist()
    sizes = [int(s) for s in args.sizes.split(",")]
    cpu_linear.pretune(sorted(set(sizes) | set(range(1, d.cfg.block_size + 3))))
    rows: list[dict[str, Any]] = []
    for n in sizes:
        rows.append({"probe": "AR step" if n == 1 else f"verify {n}",
                     **measure(verify_probe(tm, prompt, n), args.turns, args.reps, args.compare_attention,
                                 args.compare_layer_ops)})
    rows.append({"probe": "drafter pass",
                 **measure(draft_probe(tm, d, args.prompt_len), args.turns, args.reps, args.compare_attention,
                         args.compare_layer_ops)})
    rec = {"machine": {"cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "commit": _git_sha()},
           "prompt_len": args.prompt_len, "turns": args.turns, "reps": args.reps, "rows": rows}  # fmt: skip
    write_record("cpu_step_overhead", rec)
    print(f"commit {rec['machine']['commit']}  threads {rec['machine']['threads']}  (min ms over {args.turns} turns)")
    extra = [(tag, label) for tag, label, on in (("sdpa_", "SDPA", args.compare_attention),
                                                   ("torch_ops_", "torch ops", args.compare_layer_ops)) if on]
    print(f"{'probe':>13} {'ms':>8} {'stubbed':>8} {'products':>9} {'other share':>12}"
          + "".join(f" {label + ': ms':>14} {'stubbed':>8}" for _, label in extra))
    for r in rows:
        print(f"{r['probe']:>13} {r['ms']:8.2f} {r['stubbed_ms']:8.2f} {r['products_ms']:9.2f} {r['other_share']:12.2f}"
              + "".join(f" {r[tag + 'ms']:14.2f} {r[tag + 'stubbed_ms']:8.2f}" for tag, _ in extra))


if __name__ == "__main__":
    main()
