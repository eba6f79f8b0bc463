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
    # transformers is allowed only in the test helpers and the HF entry points, imported lazily.
    allowed = ("torch", "yaml", "fsdp_turbo.core", "fsdp_turbo.fsdp_turbo_config", "transformers")
    assert foreign_imports(SRC / "core", allowed) == {}
    assert foreign_imports(SRC / "core", allowed[:-1]).keys() <= {str(SRC / "core/testing/models.py"),
                                                                   str(SRC / "core/hf.py")}


def test_seed_imports_work():
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPPlanConfig, FSDPTurboConfig, QuantizeConfig, TPPlanConfig

    assert callable(FSDPTurbo)
    assert {FSDPTurboConfig, FSDPPlanConfig, TPPlanConfig, EPPlanConfig, QuantizeConfig}
