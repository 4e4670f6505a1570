"""Packaged default-world corpora (no downloads): chitchat-dataset, chatterbot-corpus (English),
reasoning-gym gsm_symbolic and many other reasoning-gym task families (procedural, seeded, disjoint
from the evaluation seeds: as many prompts as asked for), and code prompts built from functions of the
Python standard library. Every adapter is deterministic for a given config.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftforge import holdout
from draftforge.curate.config import SourceConfig
from draftforge.curate.schema import Drop, Row, normalize_messages
from draftforge.errors import StageError
from draftforge.evaluate.config import EvaluateConfig

Item = Row | Drop


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise StageError(f"curate source: package {pip_name!r} is not installed (pip install {pip_name})")
    return Path(spec.origin).parent


def _build(source: str, key: str, raw: list[dict[str, str]], min_chars: int) -> Item:
    try:
        return Row(id=f"{source}:{key}", source=source, messages=normalize_messages(raw, min_chars))
    except Drop as drop:
        return drop


def _evaluate_section(eval_cfg: Any) -> Any:
    """The evaluate section whose held-out prompts training must not see (None → its defaults)."""
    return EvaluateConfig() if eval_cfg is None else eval_cfg


def iter_chitchat(src: SourceConfig, min_chars: int, eval_cfg: Any) -> Iterator[Item]:
    """Conversations: speaker groups alternate user/assistant (utterances of one group joined by a
    newline), first `max_turns` groups, ending on a user turn (the assistant turn is regenerated)."""
    path = _package_dir("chitchat_dataset", "chitchat-dataset") / "dataset.json"
    max_turns = int(src.options.get("max_turns", 3))
    holdout_per_10k = int(_evaluate_section(eval_cfg).chitchat.holdout_per_10k)
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    for conv_id, conv in data.items():
        if holdout.chitchat_is_heldout(conv_id, holdout_per_10k):
            yield Drop("eval_holdout")
            continue
        groups = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(groups, list) or not groups:
            yield Drop("malformed", f"chitchat {conv_id}")
            continue
        raw = []
        for i, group in enumerate(groups[:max_turns]):
            text = "\n".join(u.get("text", "") for u in group if isinstance(u, dict))
            raw.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        if raw[-1]["role"] == "assistant":
            raw = raw[:-1]
        yield _build(src.name, conv_id, raw, min_chars)


def iter_chatterbot(src: SourceConfig, min_chars: int, eval_cfg: Any) -> Iterator[Item]:
    """English category files; each conversation's first statement is the prompt (its listed answers
    are alternatives, not a dialogue, so they are not kept as turns)."""
    import yaml

    root = _package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / "english"
    wanted = set(src.options.get("categories") or [])
    for file in sorted(root.glob("*.yml")):
        if wanted and file.stem not in wanted:
            continue
        try:
            doc = yaml.safe_load(file.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            yield Drop("malformed", file.name)
            continue
        for n, conv in enumerate((doc or {}).get("conversations") or []):
            if not isinstance(conv, list) or not conv:
                yield Drop("malformed", f"{file.name}#{n}")
                continue
            first = conv[0]
            if not isinstance(first, str):
                yield Drop("non_text", f"{file.name}#{n}")
                continue
            yield _build(src.name, f"{file.stem}-{n}", [{"role": "user", "content": first}], min_chars)


def _check_seeds(src: SourceConfig, seed: int, size: int, eval_cfg: Any) -> None:
    """Training seeds [seed, seed + size) must not meet the evaluation seeds (holdout.gsm_symbolic_seed_range)."""
    held = holdout.gsm_symbolic_seed_range(_evaluate_section(eval_cfg))
    if holdout.seed_ranges_overlap(range(seed, seed + size), held):
        raise StageError(
            f"curate.sources[{src.name}].options: seeds [{seed}, {seed + size}) overlap the evaluation seeds "
            f"[{held.start}, {held.stop}) (evaluate.gsm_symbolic)"
        )


def iter_gsm_symbolic(src: SourceConfig, min_chars: int, eval_cfg: Any) -> Iterator[Item]:
    """gsm_symbolic items of seeds [seed, seed + size), disjoint from evaluation's."""
    import reasoning_gym

    seed = int(src.options.get("seed", 0))
    size = int(src.options.get("size", 1000))
    _check_seeds(src, seed, size, eval_cfg)
    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
    for i in range(size):
        item = ds[i]
        yield _build(src.name, f"s{seed + i}", [{"role": "user", "content": item["question"]}], min_chars)


# reasoning-gym task families of the `reasoning_gym` source (fast generators, prompts < 1.2K chars;
# measured on the 2-core machine: 0.01-4 ms per item; zebra_puzzles 360 ms, number_sequence 240 ms and
# polynomial_multiplication 24 ms per item are left out, codeio's prompts exceed the prompt filter).
REASONING_GYM_TASKS = {
    "arithmetic": ["basic_arithmetic", "chain_sum", "decimal_arithmetic", "fraction_simplification", "gcd", "lcm",
                   "prime_factorization", "complex_arithmetic", "bitwise_arithmetic", "base_conversion", "count_bits"],
    "word_problems": ["leg_counting", "calendar_arithmetic", "time_intervals", "dice", "simple_geometry"],
    "strings": ["word_sorting", "letter_counting", "spell_backward", "caesar_cipher", "number_sorting", "sentence_reordering",
                "word_sequence_reversal", "letter_jumble", "string_manipulation", "isomorphic_strings", "ransom_note",
                "group_anagrams"],
    "logic": ["propositional_logic", "syllogism", "knights_knaves", "family_relationships"],
    "puzzles": ["shortest_path", "course_schedule", "maze", "mini_sudoku", "cryptarithm", "tower_of_hanoi",
                "rotate_matrix", "list_functions"],
}  # fmt: skip


def reasoning_gym_tasks(src: SourceConfig) -> list[str]:
    """options.tasks: task or family names (default: every family above), in order, without repeats."""
    wanted = list(src.options.get("tasks") or REASONING_GYM_TASKS)
    out: list[str] = []
    for name in wanted:
        for task in REASONING_GYM_TASKS.get(str(name), [str(name)]):
            if task not in out:
                out.append(task)
    return out


def iter_reasoning_gym(src: SourceConfig, min_chars: int, eval_cfg: Any) -> Iterator[Item]:
    """Procedural prompts of several reasoning-gym tasks, interleaved (item i of every task, then
    item i + 1, ...) so a quota spreads over all tasks; each task draws item seeds [seed, seed + size),
    disjoint from the evaluation seeds. Unbounded data: raise `size` for more rows."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    seed = int(src.options.get("seed", 0))
    size = int(src.options.get("size", 1000))
    _check_seeds(src, seed, size, eval_cfg)
    tasks = reasoning_gym_tasks(src)
    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise StageError(f"curate.sources[{src.name}].options.tasks: unknown reasoning-gym task(s) {unknown}; "
                         f"families: {sorted(REASONING_GYM_TASKS)}")
    datasets = {t: reasoning_gym.create_dataset(t, seed=seed, size=size) for t in tasks}
    for i in range(size):
        for task, ds in datasets.items():
            try:
                question = ds[i]["question"]
            except Exception as exc:  # a generator that fails on one seed: counted, not fatal
                yield Drop("generator_error", f"{task} s{seed + i}: {type(exc).__name__}")
                continue
            yield _build(src.name, f"{task}:s{seed + i}", [{"role": "user", "content": question}], min_chars)


STDLIB_TASKS = {
    "explain": "Explain what the following Python function from the standard library module `{module}` does, "
    "step by step:\n\n```python\n{code}\n```",
    "docstring": "Write a concise docstring for this Python function from `{module}`:\n\n```python\n{code}\n```",
    "complete": "Complete the body of this Python function from `{module}`:\n\n```python\n{code}\n```",
    "review": "Review this Python function from `{module}`: what could go wrong, and how would you test it?"
    "\n\n```python\n{code}\n```",
    "tests": "Write pytest unit tests for this Python function from `{module}`:\n\n```python\n{code}\n```",
    "type_hints": "Add type hints to this Python function from `{module}` and explain each choice:\n\n"
    "```python\n{code}\n```",
    "refactor": "Refactor this Python function from `{module}` for readability, keeping its behaviour:\n\n"
    "```python\n{code}\n```",
    "translate": "Rewrite this Python function from `{module}` in JavaScript:\n\n```python\n{code}\n```",
}
STDLIB_DEFAULT_TASKS = ("explain", "docstring", "complete", "review")
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}


def _strip_docstring(fn: ast.FunctionDef, lines: list[str]) -> list[str]:
    body0 = fn.body[0]
    if isinstance(body0, ast.Expr) and isinstance(getattr(body0, "value", None), ast.Constant):
        if isinstance(body0.value.value, str) and len(fn.body) > 1:
            first, last = body0.lineno - fn.lineno, body0.end_lineno - fn.lineno
            return lines[:first] + lines[last + 1 :]
    return lines


def iter_stdlib_code(src: SourceConfig, min_chars: int, eval_cfg: Any) -> Iterator[Item]:
    """Prompts per top-level or method function of lines in [min_lines, max_lines]: `tasks_per_function`
    (default 1) distinct tasks of `tasks` (default explain / docstring / complete / review; also tests,
    type_hints, refactor, translate), the first chosen by a hash of the function's qualified name."""
    root = Path(src.options.get("root") or sysconfig.get_paths()["stdlib"])
    tasks = list(src.options.get("tasks") or STDLIB_DEFAULT_TASKS)
    per_fn = max(1, min(len(tasks), int(src.options.get("tasks_per_function", 1))))
    bad = [t for t in tasks if t not in STDLIB_TASKS]
    if bad:
        raise StageError(f"curate.sources[{src.name}].options.tasks: unknown {bad}; use {list(STDLIB_TASKS)}")
    lo, hi = int(src.options.get("min_function_lines", 4)), int(src.options.get("max_function_lines", 30))
    files = sorted(p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1])))
    for file in files:
        rel = file.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            text = file.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            yield Drop("malformed", str(rel))
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            fn_lines = lines[start - 1 : node.end_lineno]
            if not lo <= len(fn_lines) <= hi:
                continue
            key = f"{module}.{node.name}:{node.lineno}"
            first = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(tasks)
            for j in range(per_fn):
                task = tasks[(first + j) % len(tasks)]
                code_lines = fn_lines
                if task == "docstring":
                    code_lines = _strip_docstring(node, fn_lines[node.lineno - start :])
                elif task == "complete":
                    code_lines = fn_lines[: max(2, len(fn_lines) // 2)]
                indent = min((len(s) - len(s.lstrip()) for s in code_lines if s.strip()), default=0)
                code = "\n".join(s[indent:] for s in code_lines)
                prompt = STDLIB_TASKS[task].format(module=module, code=code)
                row_key = key if j == 0 else f"{key}:{task}"  # the first task keeps the single-task id
                yield _build(src.name, row_key, [{"role": "user", "content": prompt}], min_chars)


PACKAGED = {
    "chitchat": iter_chitchat,
    "chatterbot": iter_chatterbot,
    "gsm_symbolic": iter_gsm_symbolic,
    "stdlib_code": iter_stdlib_code,
    "reasoning_gym": iter_reasoning_gym,
}


def iter_packaged(src: SourceConfig, *, min_chars: int, eval_cfg: Any = None) -> Iterator[Item]:
    return PACKAGED[src.kind](src, min_chars, eval_cfg)
