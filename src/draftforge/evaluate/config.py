"""Typed config of the `evaluate` stage (torch-free). Owned by the evaluate stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from draftforge.drafter.registry import method_order, tree_methods
from draftforge.errors import check

COMPUTE_DTYPES = ("", "float32", "bfloat16", "float16")
ENGINES = ("eager", "captured", "compiled")
# Sanity bounds (compose-time): a tree of more nodes than MAX_BUDGET, or more than MAX_NEW_TOKENS new tokens
# per answer, only allocates for minutes before failing. The evaluate stage also refuses max_new_tokens above
# the target's max_position_embeddings once it has read target.json.
MAX_BUDGET = 4096
MAX_NEW_TOKENS = 32768


def check_methods_known(methods: List[str]) -> None:
    """Every `evaluate.methods` name is `ar` or an engine method of a registered drafter type. Called by
    `config.compose` once the listed drafters' types are loaded (a plugin type's methods count only then), so
    a typo (`dsprk`) fails at compose instead of being dropped by every branch's method filter."""
    known = list(method_order())
    unknown = [m for m in methods if m not in known]
    check(not unknown, "evaluate.methods", f"unknown {unknown}; known: {', '.join(known)} (a plugin type's methods "
          "are known once its drafter is listed in `drafters`)")


@dataclass
class GsmSymbolicEvalConfig:
    """Held-out reasoning-gym `gsm_symbolic` problems.

    reasoning-gym draws item i of `create_dataset(seed=s)` from Random(s + i): evaluation uses item
    seeds [seed, seed + size). Training (curate) must draw its items from seeds outside that range.
    """

    seed: int = 1_000_000_000
    size: int = 200  # reserved pool (>= num_prompts); the whole pool is decontaminated

    def __post_init__(self) -> None:
        check(self.size >= 1, "evaluate.gsm_symbolic.size", f"{self.size} must be >= 1")


@dataclass
class ChitchatEvalConfig:
    """Held-out `chitchat-dataset` conversations: id is held out iff
    int(sha256(id)[:8], 16) % 10000 < holdout_per_10k (deterministic, order-independent)."""

    holdout_per_10k: int = 300  # ~3% of the 7.2K conversations (~210) never go to training
    max_turns: int = 3  # prompt = first turns up to the last user turn among the first max_turns

    def __post_init__(self) -> None:
        check(0 <= self.holdout_per_10k <= 10000, "evaluate.chitchat.holdout_per_10k", f"{self.holdout_per_10k} must be in [0, 10000]")
        check(self.max_turns >= 1, "evaluate.chitchat.max_turns", f"{self.max_turns} must be >= 1")


@dataclass
class LongContextEvalConfig:
    """The `long_context` set (evaluate/long_context.py): stdlib-source and chat-transcript prompts of at least
    min_tokens tokens; `size` prompts, half of each kind. Not in the default `datasets` (on 2 CPU cores one such
    prompt's prefill took 48 s for 5,000 tokens of the 135M target, for every method and repeat): add it (`evaluate.datasets=[...,long_context]`)."""

    min_tokens: int = 4096
    size: int = 8

    def __post_init__(self) -> None:
        check(self.min_tokens >= 1, "evaluate.long_context.min_tokens", f"{self.min_tokens} must be >= 1")
        check(self.size >= 1, "evaluate.long_context.size", f"{self.size} must be >= 1")


@dataclass
class SamplingCheckConfig:
    """The lossless check at T > 0 (evaluate/sampling_check.py): every first-repeat response at T > 0 gets one
    teacher-forced target forward (outside the timed part); its tokens' PIT values are tested for uniformity
    per row and pooled per method. `alpha`: the test's level; `bins`: the χ² histogram's bins."""

    enabled: bool = True
    bins: int = 10
    alpha: float = 0.001

    def __post_init__(self) -> None:
        check(2 <= self.bins <= 1000, "evaluate.sampling_check.bins", f"{self.bins} must be in [2, 1000]")
        check(0.0 < self.alpha < 1.0, "evaluate.sampling_check.alpha", f"{self.alpha} must be in (0, 1)")


@dataclass
class EvaluateConfig:
    # Packaged default-world sets: humaneval, gsm_symbolic, chitchat, mt_bench (80 two-turn questions); also
    # packaged, not run by default: long_context (prompts >= long_context.min_tokens tokens).
    # Local-file sets (path in dataset_files): gsm8k, math500, humaneval_file, mbpp, mtbench, alpaca.
    datasets: List[str] = field(default_factory=lambda: ["humaneval", "gsm_symbolic", "chitchat", "mt_bench"])
    dataset_files: Dict[str, str] = field(default_factory=dict)
    num_prompts: int = 10  # per dataset (0 = all)
    max_new_tokens: int = 128
    temperatures: List[float] = field(default_factory=lambda: [0.0])
    # At each temperature above 0: the sets (those of `datasets` listed here; a listed set that is not evaluated
    # is skipped with a warning) and prompts per set evaluated, the first `sampled_prompts` of the T = 0 ones (a
    # sampling pass costs what the greedy pass does, so a CPU run samples a subset). [] / 0 = the same as at
    # T = 0. vLLM baselines follow (evaluate/prompts.prompts_at).
    sampled_datasets: List[str] = field(default_factory=list)
    sampled_prompts: int = 0
    sampling_check: SamplingCheckConfig = field(default_factory=SamplingCheckConfig)
    methods: List[str] = field(default_factory=lambda: ["ar", "dflash", "ddtree"])
    budgets: List[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024])
    mtp_drafts: int = 3  # draft tokens per round of the `mtp` method (the MTP layer applied recursively)
    gpus: int = 0  # 0 = CPU; N = one model copy per GPU rank (torchrun --nproc_per_node N)
    warmup: int = 1  # prompts run (and discarded) per method before measuring
    # Timed passes over the prompts (interleaved, see evaluate/runner.py): rows report the median tokens/s
    # and speedup over repeats with their min and max. Tokens are the same in every repeat at T = 0.
    repeats: int = 3
    # Per dataset, the prompts of the same held-out pool right after the evaluation ones: the tree methods'
    # τ and round cost by budget on them choose the auto budget (evaluate/budget.py). 0 = no calibration.
    calibration_prompts: int = 2
    seed: int = 0  # sampling seed at T > 0 (per prompt: seed + prompt index)
    dtype: str = ""  # "" → float32 on CPU, target.dtype on GPU
    # Target/drafter steps: eager, or captured (static shapes at a fixed capacity, one CUDA graph per verify
    # size on a GPU; on CPU the static step runs eagerly). Tokens are the same either way.
    engine: str = "eager"  # eager | captured (CUDA graphs) | compiled (captured + torch.compile, fused projections)
    engine_capacity: int = 4096  # captured: KV rows (prompt + max_new_tokens + largest verify must fit)
    gsm_symbolic: GsmSymbolicEvalConfig = field(default_factory=GsmSymbolicEvalConfig)
    chitchat: ChitchatEvalConfig = field(default_factory=ChitchatEvalConfig)
    long_context: LongContextEvalConfig = field(default_factory=LongContextEvalConfig)
    # Evaluate a drafter trained in another chat mode (target.chat_template_kwargs) anyway: rows carry
    # `chat_mode_mismatch`; false refuses it in one line (draftforge.chat.check_served).
    allow_chat_mode_mismatch: bool = False

    def __post_init__(self) -> None:
        check(bool(self.datasets), "evaluate.datasets", "empty, nothing to evaluate; name at least one prompt set "
              "(e.g. evaluate.datasets=[humaneval,gsm_symbolic,chitchat])")
        check(bool(self.methods), "evaluate.methods", "empty; list at least one method (ar, dflash, ddtree, ...)")
        trees = bool(set(self.methods) & set(tree_methods()))  # a tree method is planned: budgets matter
        check(all(int(b) >= 1 for b in self.budgets) and (bool(self.budgets) or not trees),
              "evaluate.budgets", f"{list(self.budgets)} must be a non-empty list of integers >= 1")  # fmt: skip
        check(bool(self.temperatures) and all(t >= 0 for t in self.temperatures), "evaluate.temperatures",
              f"{list(self.temperatures)} must be a non-empty list of values >= 0")  # fmt: skip
        check(self.sampled_prompts >= 0, "evaluate.sampled_prompts", f"{self.sampled_prompts} must be >= 0 (0 = num_prompts)")
        check(self.max_new_tokens >= 1, "evaluate.max_new_tokens", f"{self.max_new_tokens} must be >= 1")
        check(self.max_new_tokens <= MAX_NEW_TOKENS, "evaluate.max_new_tokens",
              f"{self.max_new_tokens} is above the limit of {MAX_NEW_TOKENS} new tokens per answer")
        check(all(int(b) <= MAX_BUDGET for b in self.budgets), "evaluate.budgets",
              f"{list(self.budgets)}: a tree budget above {MAX_BUDGET} nodes is refused")
        check(self.num_prompts >= 0, "evaluate.num_prompts", f"{self.num_prompts} must be >= 0 (0 = all)")
        check(self.gpus >= 0, "evaluate.gpus", f"{self.gpus} must be >= 0")
        check(self.warmup >= 0, "evaluate.warmup", f"{self.warmup} must be >= 0")
        check(isinstance(self.repeats, int) and self.repeats >= 1, "evaluate.repeats", f"{self.repeats} must be an integer >= 1")
        check(isinstance(self.calibration_prompts, int) and self.calibration_prompts >= 0, "evaluate.calibration_prompts",
              f"{self.calibration_prompts} must be an integer >= 0 (0 = no calibration, no auto budget)")  # fmt: skip
        check(self.mtp_drafts >= 1, "evaluate.mtp_drafts", f"{self.mtp_drafts} must be >= 1")
        check(self.engine in ENGINES, "evaluate.engine", f"{self.engine!r} is not one of {list(ENGINES)}")
        check(self.engine_capacity >= 1, "evaluate.engine_capacity", f"{self.engine_capacity} must be >= 1")
        if self.engine != "eager":  # the fixed capacity holds prompt + max_new_tokens + the largest verify
            verify = 1 + (max(int(b) for b in self.budgets) if trees else 0)
            need = self.max_new_tokens + verify
            check(need < self.engine_capacity, "evaluate.engine_capacity",
                  f"{self.engine_capacity} rows cannot hold evaluate.max_new_tokens {self.max_new_tokens} + a verify "
                  f"of {verify} (+ the prompt); raise it or lower max_new_tokens / budgets")
        check(self.dtype in COMPUTE_DTYPES, "evaluate.dtype", f"{self.dtype!r} is not one of {list(COMPUTE_DTYPES)}")
