"""Typed config of the `extract` stage (torch-free). Owned by the extract stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from draftforge.errors import check

STORAGE_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ExtractConfig:
    gpus: int = 0  # 0 = CPU (gloo); N = torchrun over N GPUs (NCCL); Snakemake asks resources: gpu=N
    cpu_procs: int = 1  # processes on CPU when gpus == 0
    device: str = "auto"  # auto (cuda:LOCAL_RANK when gpus > 0 and CUDA exists, else cpu) | cpu | cuda
    storage_dtype: str = "bfloat16"  # bfloat16 | float32 | float8_e4m3fn (per token·tap scales)
    # Compute dtype of the target: "" = target.dtype on CUDA, float32 on CPU.
    compute_dtype: str = ""
    # auto = eager on CPU (bit-exact under right padding), sdpa on CUDA; or eager | sdpa | flash_attention_2
    attn_implementation: str = "auto"
    splits: List[str] = field(default_factory=lambda: ["train", "val"])  # curate splits to extract (a split without files is skipped)
    tokens_per_batch: int = 16384  # padded tokens (rows × longest row) per forward
    # A batch takes the next (shorter) sequence only while its valid tokens stay ≥ batch_fill × its padded tokens:
    # padding is computed like any token, and on a CPU a one-sequence batch already fills the matmuls.
    batch_fill: float = 0.9
    max_seq_len: int = 3072  # longer sequences are truncated (counted in index.json)
    # Shard = fixed set of sequences (independent of world size): rows of one sort window, sorted by
    # length, cut greedily at tokens_per_shard tokens or seqs_per_shard sequences.
    tokens_per_shard: int = 65536  # Qwen3-8B, 5 taps, bf16: 40 KiB/token → 2.5 GiB per shard
    seqs_per_shard: int = 4096
    sort_window: int = 8192  # consecutive input rows sorted together by length (bucketing scope)
    writer_threads: int = 2  # background shard writers (each holds one host buffer of a shard)
    stop_after_last_tap: bool = True  # skip later layers and the LM head
    disk_margin: float = 1.05  # required free bytes = estimate × margin
    verify_resumed: bool = True  # re-hash shards found complete from an earlier run before indexing
    dist_timeout_min: int = 720  # torch.distributed timeout (ranks wait at the final barrier)
    # Jobs the extraction fans out into: K > 1 = Snakemake rules extract_part (part k: the k-th contiguous range of
    # the plan's shards, each resumable) and `extract`, which merges their done shards into index.json. The plan,
    # and so the shards and the index, are the same for any K (docs/cluster.md); 1 = one job, as before.
    jobs: int = 1
    part: int = -1  # set by the extract_part rule only: this job's shard range (-1 = every shard, or the merge)

    def __post_init__(self) -> None:
        check(self.gpus >= 0, "extract.gpus", f"{self.gpus} must be >= 0")
        check(self.cpu_procs >= 1, "extract.cpu_procs", f"{self.cpu_procs} must be >= 1")
        check(self.device in DEVICES, "extract.device", f"{self.device!r}: use one of {', '.join(DEVICES)}")
        check(self.storage_dtype in STORAGE_DTYPES, "extract.storage_dtype", f"{self.storage_dtype!r}: use one of {list(STORAGE_DTYPES)}")
        check(self.jobs >= 1, "extract.jobs", f"{self.jobs} must be >= 1")
        check(-1 <= self.part < self.jobs, "extract.part", f"{self.part} must be -1 (all) or in [0, extract.jobs={self.jobs})")
        check(0.0 <= self.batch_fill <= 1.0, "extract.batch_fill", f"{self.batch_fill} must be in [0, 1]")
        check(self.tokens_per_batch >= 1 and self.max_seq_len >= 1, "extract.tokens_per_batch/max_seq_len", "must be >= 1")
