"""Shared entry for every stage: `python -m draftforge.<stage> experiment=NAME [hydra overrides...]`.

Stages never use the network: importing this module (every stage's `__main__` imports it first, before its
stage module, MLflow, vLLM or huggingface_hub) sets NO_NETWORK_ENV where the caller left it unset.

Also under torchrun or srun tasks (RANK/WORLD_SIZE set; draftforge.launch): every rank composes the same config; only rank 0 logs to
MLflow and writes provenance. A StageError becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from draftforge.chat import RECORD_KEY, ChatMode
from draftforge.config import compose, config_hash, stage_params
from draftforge.errors import StageError
from draftforge.launch import apply_slurm_ranks
from draftforge.paths import stage_dir, stage_marker, work_dir
from draftforge.provenance import git_state
from draftforge.stages import PER_DRAFTER, stage_inputs

# MLflow fetches its telemetry config at import unless told not to (DO_NOT_TRACK must be "true" for it, vLLM
# only needs it set); vLLM reports usage stats; the HF libraries look models up on the hub. Read at import
# by each library, so set before any of them is imported; child processes (torchrun ranks, baselines
# workers, curate's vLLM engine) inherit them.
NO_NETWORK_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                  "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def no_network_env() -> None:
    for key, value in NO_NETWORK_ENV.items():
        os.environ.setdefault(key, value)


no_network_env()  # before a stage module is imported (none of the imports above imports those libraries)
apply_slurm_ranks()  # an srun task of draftforge.launch: RANK / WORLD_SIZE / LOCAL_RANK from SLURM's variables

log = logging.getLogger("draftforge")

@dataclass
class StageContext:
    stage: str
    cfg: DictConfig
    experiment: str
    results_root: Path
    out_dir: Path  # declared outputs (Snakemake may delete it on failure)
    work_dir: Path  # resumable state kept outside declared outputs
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    config_hash: str = ""
    drafter: str | None = None  # the branch of a per-drafter stage (cfg.drafter.name); None for the others

    def input_dir(self, stage: str, drafter: str | None = None) -> Path:
        """An upstream stage's folder; a per-drafter stage's is this branch's unless `drafter` names another."""
        return stage_dir(self.results_root, self.experiment, stage, self.branch_of(stage, drafter))

    def input_marker(self, stage: str, drafter: str | None = None) -> Path:
        """The upstream stage's marker file; a clear error if that stage has not finished."""
        path = stage_marker(self.results_root, self.experiment, stage, self.branch_of(stage, drafter))
        if not path.is_file():
            raise StageError(f"{path}: missing; run the `{stage}` stage first (snakemake --until {stage})")
        return path

    def branch_of(self, stage: str, drafter: str | None) -> str | None:
        """The drafter branch of `stage` as this context reads it: None for a once-stage, else `drafter`, this
        context's branch, or the composed drafter's name."""
        return (drafter or self.drafter or str(self.cfg.drafter.name)) if stage in PER_DRAFTER else None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def tracking_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for draftforge.tracking.mlflow_run with this stage's standard tags."""
        return dict(
            results_root=self.results_root,
            experiment=self.experiment,
            stage=self.stage,
            uri=self.cfg.tracking.uri,
            enabled=self.cfg.tracking.enabled,
            tags={"config_hash": self.config_hash, "git_sha": git_state()["sha"], "target": self.cfg.target.name,
                  **({"drafter": self.drafter} if self.drafter else {})},
        )


def parse_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Split `experiment=NAME` from the other Hydra overrides (default experiment: default)."""
    experiment = "default"
    overrides: list[str] = []
    for arg in argv:
        if arg.startswith("experiment="):
            experiment = arg.split("=", 1)[1]
        elif "=" in arg:
            overrides.append(arg)
        else:
            raise StageError(f"argument {arg!r}: expected a Hydra override key=value (e.g. experiment=smoke)")
    return experiment, overrides


def configure_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s", stream=sys.stderr)
    if not sys.stderr.isatty():  # progress bars in redirected logs: one line every 30 s
        os.environ.setdefault("TQDM_MININTERVAL", "30")
    for noisy in ("alembic", "mlflow", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def make_context(stage: str, argv: Sequence[str]) -> StageContext:
    experiment, overrides = parse_argv(argv)
    cfg = compose(experiment, overrides)
    results_root = Path(cfg.results_root)
    drafter = str(cfg.drafter.name) if stage in PER_DRAFTER else None
    return StageContext(
        stage=stage,
        cfg=cfg,
        experiment=cfg.experiment_name,
        results_root=results_root,
        out_dir=stage_dir(results_root, cfg.experiment_name, stage, drafter),
        work_dir=work_dir(results_root, cfg.experiment_name, stage, drafter),
        drafter=drafter,
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        params=stage_params(cfg, stage),
        config_hash=config_hash(cfg, stage),
    )


def write_stage_provenance(ctx: StageContext, extra: dict[str, Any] | None = None) -> None:
    from draftforge.provenance import write_provenance

    if not ctx.is_rank0:
        return
    inputs = {}
    for up in stage_inputs(ctx.stage, ctx.cfg):
        branches = [ctx.branch_of(up, None)] if ctx.stage in PER_DRAFTER or up not in PER_DRAFTER else list(ctx.cfg.drafters)
        for d in branches:
            path = stage_marker(ctx.results_root, ctx.experiment, up, d)
            if path.is_file():
                inputs[f"{up}/{d}" if d else up] = path
    # The chat mode this stage renders conversations in (its target.chat_template_kwargs; {} = template defaults),
    # recorded by every stage even where the params leave it out at its default.
    extra = {RECORD_KEY: ChatMode.of(ctx.cfg).kwargs, **(extra or {})}
    write_provenance(ctx.out_dir, stage=ctx.stage, config=ctx.params, config_hash=ctx.config_hash, inputs=inputs, extra=extra)


def run_stage(stage: str, main: Callable[[StageContext], None], argv: Sequence[str] | None = None) -> None:
    """Compose the config, run `main(ctx)`, turn StageError into one line + exit 2.

    Convention for `main`: write every output atomically; write the marker file
    (stages.STAGE_MARKERS[stage]) last, so its presence means the stage finished.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank)
    try:
        ctx = make_context(stage, argv)
        make_stage_dirs(ctx)
        write_stage_provenance(ctx)
        main(ctx)
    except StageError as exc:
        print(f"draftforge {stage}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"draftforge {stage}: interrupted; rerun the same command to resume", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        print(f"draftforge {stage}: error: disk full or write failed ({full}); free space and rerun the same command "
              "(finished shards and checkpoints are kept)", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None


def make_stage_dirs(ctx: StageContext) -> None:
    for path in (ctx.out_dir, ctx.work_dir):
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as exc:
            raise StageError(f"results_root={ctx.results_root}: cannot create or write {path} "
                             f"({exc.strerror or exc}); set results_root to a writable folder") from None  # fmt: skip


# What a full disk looks like through sqlite (MLflow) and torch.save's zip writer.
_DISK_FULL_TEXT = ("no space left on device", "database or disk is full", "disk quota exceeded", "file write failed",
                   "unexpected pos")


def disk_full(exc: BaseException) -> str | None:
    """A short description when `exc` (or anything in its chain) is a full disk, else None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{cur.filename or cur.strerror}" if cur.filename else str(cur.strerror)
        text = str(cur).lower()
        if any(t in text for t in _DISK_FULL_TEXT):
            return str(cur).strip().splitlines()[0][:200]
        todo += [cur.__cause__, cur.__context__]
    return None

