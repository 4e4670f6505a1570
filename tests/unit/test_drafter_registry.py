"""The drafter-type registry (drafter/registry.py): the built-in types' rules, and a plugin type that is one
module plus one drafter file (tests/plugins/toy_drafter.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from draftforge.drafter import registry
from draftforge.drafter.registry import DrafterType, drafter_type, register_drafter_type
from draftforge.drafter.settings import branch_methods, branch_vllm_methods, default_loss_weights
from draftforge.errors import ConfigError

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def test_builtin_types_state_the_branch_rules():
    rules = {n: (t.engine_methods, t.tree_methods, t.chain_method, t.vllm_methods, dict(t.default_loss_weights), t.artifact)
             for n, t in registry.drafter_types().items() if n in ("dflash", "dspark", "mtp")}
    assert rules == {
        "dflash": (("dflash", "ddtree", "ddtree_lookup"), ("ddtree", "ddtree_lookup"), "dflash", ("dflash", "ngram", "eagle3"),
                   {"ce": 1.0}, "drafter"),
        "dspark": (("dspark", "ddtree", "ddtree_lookup", "ddtree_markov"), ("ddtree", "ddtree_lookup", "ddtree_markov"),
                   "dspark", ("dspark",),
                   {"tv": 1.8, "ce": 0.1}, "drafter"),
        "mtp": (("mtp",), (), "mtp", ("mtp",), {"ce": 1.0}, "mtp"),
    }
    assert registry.tree_methods()[:3] == ("ddtree", "ddtree_lookup", "ddtree_markov")
    assert registry.served_vllm_methods()[:3] == ("dflash", "dspark", "mtp")
    assert registry.artifact_of_method("ddtree") == "drafter" and registry.artifact_of_method("ar") is None
    assert registry.source_key_of_method("mtp") == "mtp_source" and registry.source_key_of_method("dflash") is None
    assert registry.reference_type().name == "mtp"
    order = registry.method_order()
    assert sorted(order, key=order.get)[:7] == ["ar", "mtp", "dflash", "dspark", "ddtree", "ddtree_lookup", "ddtree_markov"]
    assert branch_methods("dspark", ["ar", "dflash", "ddtree", "mtp", "dspark", "ddtree_markov"]) == ["ar", "ddtree", "dspark", "ddtree_markov"]
    assert branch_vllm_methods("dflash", ["ar", "ngram", "dflash", "dspark", "mtp"]) == ["ar", "ngram", "dflash"]
    assert default_loss_weights("dspark") == {"tv": 1.8, "ce": 0.1}


def test_registry_import_is_torch_free():
    import subprocess

    code = ("import sys; from draftforge.drafter import registry; registry.drafter_types(); "
            "import draftforge.config; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_registrations_and_names_are_refused():
    with pytest.raises(ValueError, match="registered twice"):
        register_drafter_type(lambda: DrafterType(name="dflash", title="x", chain_method="dflash"))
    with pytest.raises(ValueError, match="artifact"):
        DrafterType(name="x", title="x", chain_method="y", artifact="weights")
    with pytest.raises(ValueError, match="reference"):
        DrafterType(name="x", title="x", chain_method="ar")
    with pytest.raises(ConfigError, match=r"drafter.type: 'nope' is not a registered drafter type"):
        drafter_type("nope")


def test_model_config_is_derived_in_one_place():
    """registry.build_model_config (DFlashConfig.from_target / DSparkConfig.shape_fields) builds what the
    train stage builds today, and the shape defaults are the drafter section's."""
    from omegaconf import OmegaConf

    from draftforge.drafter.config import DFlashConfig
    from draftforge.drafter.dspark import DSparkConfig
    from draftforge.drafter.settings import DrafterConfig
    from draftforge.train.stage import drafter_config

    info = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "vocab_size": 100,
            "num_layers": 6, "drafter": {"mask_token_id": 5, "target_layer_ids": [1, 3]}}
    for shape in (DrafterConfig(), DrafterConfig(name="dspark", type="dspark"),
                  DrafterConfig(name="d0", type="dspark", markov_rank=0, bonus_anchor=True, block_size=8)):
        node = OmegaConf.structured(shape)
        assert registry.build_model_config(node, info) == drafter_config(node, info)
    assert DFlashConfig.__dataclass_fields__["block_size"].default == DrafterConfig.block_size
    assert DSparkConfig.__dataclass_fields__["markov_rank"].default == DrafterConfig.markov_rank


@pytest.fixture()
def toy_conf(tmp_path, monkeypatch) -> Path:
    """A copy of conf/ with the toy drafter's file; its module importable (tests/plugins on sys.path)."""
    from draftforge.paths import CONF_DIR

    sys.path.insert(0, str(PLUGINS))
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    sys.path_importer_cache.clear()
    import toy_drafter

    (conf / "drafter" / "toy.yaml").write_text(toy_drafter.TOY_YAML)
    yield conf
    sys.path.remove(str(PLUGINS))


def test_plugin_type_is_one_module_and_one_file(toy_conf):
    from draftforge.config import compose, stage_params
    from draftforge.drafter.settings import needs_last_layer

    cfg = compose("smoke", ["drafters=[dflash,toy]", "drafter=toy"], conf_dir=toy_conf)
    kind = registry.type_of(cfg.drafter)
    assert kind.name == "toy" and kind.module == "toy_drafter"
    assert branch_methods("toy", ["ar", "dflash", "ddtree"]) == ["ar", "dflash"]
    assert branch_vllm_methods("toy", ["ar", "ngram", "dflash"]) == ["ar"]
    assert not needs_last_layer(cfg, toy_conf)  # the toy reads no last layer: extract is not rerun for it
    assert stage_params(cfg, "train")["drafter"]["module"] == "toy_drafter"
    dflash = compose("smoke", ["drafters=[dflash,toy]"], conf_dir=toy_conf)
    assert "module" not in stage_params(dflash, "train")["drafter"]  # a built-in's params are unchanged


def test_plugin_module_that_does_not_import_is_one_clear_error(toy_conf):
    from draftforge.config import compose

    (toy_conf / "drafter" / "toy.yaml").write_text("name: toy\ntype: toy\nmodule: no_such_drafter_module\n")
    with pytest.raises(ConfigError, match="drafter.module: cannot import 'no_such_drafter_module'"):
        compose("smoke", ["drafters=[dflash,toy]", "drafter=toy"], conf_dir=toy_conf)


def test_type_order_does_not_depend_on_which_module_was_imported_first():
    import subprocess
    import sys

    code = ("import draftforge.drafter.types.mtp, draftforge.drafter.types.dspark\n"
            "from draftforge.drafter import registry\n"
            "assert list(registry.drafter_types())[:3] == ['dflash', 'dspark', 'mtp'], list(registry.drafter_types())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
