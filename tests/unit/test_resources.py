"""The `resources` config section: typed, inherited from `resources.default`, and read by no stage."""

from __future__ import annotations

import pytest

from draftforge.config import compose, stage_overrides, stage_params
from draftforge.errors import ConfigError
from draftforge.resources import OWN_GPUS, StageResources, stage_resources
from draftforge.stages import STAGES

OVERRIDES = ["resources.default.cpus=4", "resources.default.mem_mb=3000", "resources.extract.mem_mb=64000",
             "resources.train.runtime=720", "resources.train.partition=gpu"]  # fmt: skip


def test_defaults_request_nothing() -> None:
    cfg = compose("smoke")
    for stage in STAGES:
        assert stage_resources(cfg.resources, stage) == StageResources()


def test_a_stage_inherits_each_unset_field_from_default() -> None:
    cfg = compose("smoke", OVERRIDES)
    assert stage_resources(cfg.resources, "extract") == StageResources(cpus=4, mem_mb=64000)
    assert stage_resources(cfg.resources, "train") == StageResources(cpus=4, mem_mb=3000, runtime=720, partition="gpu")
    assert stage_resources(cfg.resources, "report") == StageResources(cpus=4, mem_mb=3000)


@pytest.mark.parametrize(("override", "named"), [("resources.extract.cpus=-1", "resources.extract.cpus: -1 must be >= 0"),
                                                  ("resources.trian.cpus=1", "trian"),
                                                  ("resources.default.mem_mb=lots", "resources.default.mem_mb"),
                                                  ("resources.default.gpus=1", "resources.default.gpus: GPUs are set per stage"),
                                                  ("resources.train.gpus=1", "resources.train.gpus: 1: train.gpus sets")])  # fmt: skip
def test_a_bad_value_fails_at_compose_naming_the_key(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose("smoke", [override])
    assert named in str(err.value)


def test_no_stage_reads_the_section() -> None:
    """Changing what a job asks the scheduler for never reruns a stage nor enters its command."""
    plain, scheduled = compose("smoke"), compose("smoke", OVERRIDES)
    for stage in STAGES:
        assert stage_params(scheduled, stage) == stage_params(plain, stage)
        assert stage_overrides(stage, OVERRIDES) == []


def test_gpus_here_only_for_the_stages_without_their_own() -> None:
    cfg = compose("smoke", ["resources.baselines.gpus=1", "resources.curate.gpus=2"])
    assert set(OWN_GPUS) == {stage for stage in STAGES if "gpus" in cfg[stage]}
    assert stage_resources(cfg.resources, "baselines").gpus == 1 and stage_resources(cfg.resources, "curate").gpus == 2
