"""HF regeneration out of device memory: the batch is generated again as halves, each row keeps its own
answer (same tokens as the unsplit batch), and a single row that does not fit still fails."""

from __future__ import annotations

import pytest
import torch

from draftforge.curate.config import RegenerateConfig
from draftforge.curate.regenerate import HFBackend
from draftforge.curate.tokenize import end_of_turn_ids


class _OOMAbove:
    """A target whose generate runs out of memory above `limit` rows."""

    def __init__(self, model, limit: int) -> None:
        self.model, self.limit, self.sizes = model, limit, []

    @property
    def device(self):
        return self.model.device

    def generate(self, **kw):
        n = kw["input_ids"].shape[0]
        self.sizes.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (test: {n} rows > {self.limit})")
        return self.model.generate(**kw)


def test_out_of_memory_splits_the_batch_and_keeps_every_rows_answer(tiny_target_info):
    from draftforge.target.load import load_target_model, load_tokenizer

    model, tok = load_target_model(tiny_target_info), load_tokenizer(tiny_target_info)
    eot = end_of_turn_ids(tok, [2])
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (7 + i % 3,), generator=g).tolist() for i in range(10)]
    seeds = list(range(10))
    want = HFBackend(model, tok, cfg, eot).generate(prompts, seeds)
    small = _OOMAbove(model, limit=3)
    got = HFBackend(small, tok, cfg, eot).generate(prompts, seeds)
    assert small.sizes == [8, 4, 2, 2, 4, 2, 2, 2]  # 8 → 4 + 4 → 2 + 2 each; the last batch (2 rows) fits
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finished for g in got] == [w.finished for w in want]


def test_a_single_row_out_of_memory_is_raised(tiny_target_info):
    from draftforge.target.load import load_target_model, load_tokenizer

    model, tok = load_target_model(tiny_target_info), load_tokenizer(tiny_target_info)
    cfg = RegenerateConfig(max_new_tokens=2, batch_size=2)
    backend = HFBackend(_OOMAbove(model, limit=0), tok, cfg, end_of_turn_ids(tok, [2]))
    with pytest.raises(torch.OutOfMemoryError):
        backend.generate([[5, 6, 7], [8, 9, 10]], [0, 1])
