"""turbo-core's packaging: namespace layout, version, and what it may import."""

from importlib.metadata import version
from pathlib import Path

import fsdp_turbo
import fsdp_turbo.core
from fsdp_turbo.core.testing.imports import foreign_imports

SRC = Path(fsdp_turbo.core.__file__).resolve().parents[1]


def test_fsdp_turbo_is_a_namespace_package():
    assert getattr(fsdp_turbo, "__file__", None) is None
    assert not (SRC / "__init__.py").exists()


def test_version_is_the_package_version():
    assert version("turbo-core") == fsdp_turbo.core.__version__


def test_core_imports_no_feature_package():
    # transformers (and its hub library) only in the test helpers (the ranks' preload builds its
    # conversion table) and the HF entry points, lazily.
    # pytest only in the test harness's pytest plugins (rank pools, the skip rule).
    allowed = ("torch", "yaml", "fsdp_turbo.core", "fsdp_turbo.fsdp_turbo_config")
    assert foreign_imports(SRC / "core", (*allowed, "transformers", "huggingface_hub", "pytest")) == {}
    assert foreign_imports(SRC / "core", allowed).keys() <= {str(SRC / "core/testing/models.py"),
                                                              str(SRC / "core/testing/pytest_plugin.py"),
                                                              str(SRC / "core/testing/skips.py"),
                                                              str(SRC / "core/testing/warm.py"),
                                                              str(SRC / "core/hf.py")}


def test_checkpoint_imports_torch_safetensors_and_core_only():
    # transformers only through core.hf; safetensors is the reader and writer; peft (lazily,
    # for a PEFT model only) in the one module that saves and loads adapters.
    allowed = ("torch", "safetensors", "fsdp_turbo.core", "fsdp_turbo.checkpoint")
    assert foreign_imports(SRC / "checkpoint", (*allowed, "peft")) == {}
    assert foreign_imports(SRC / "checkpoint", allowed).keys() <= {str(SRC / "checkpoint" / "peft_adapters.py")}


def test_seed_imports_work():
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPPlanConfig, FSDPTurboConfig, QuantizeConfig, TPPlanConfig

    assert callable(FSDPTurbo)
    # The seed's names build the seed's objects: each plan fits its field of the whole config.
    config = FSDPTurboConfig(fsdp_plan=FSDPPlanConfig(), tp_plan=TPPlanConfig(), ep_plan=EPPlanConfig(),
                             quantization_plan=QuantizeConfig())
    assert (type(config.fsdp_plan), type(config.tp_plan), type(config.ep_plan), type(config.quantization_plan)) == (
        FSDPPlanConfig, TPPlanConfig, EPPlanConfig, QuantizeConfig)
