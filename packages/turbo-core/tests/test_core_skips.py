"""The skip rule (``fsdp_turbo.core.testing.skips``), each case in a pytest session of its own."""

import pytest

from fsdp_turbo.core.testing import skips

SKIPPING = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("peft is not installed")
"""


def _session(pytester):
    pytester.makepyfile(SKIPPING)
    return pytester.runpytest("-p", "fsdp_turbo.core.testing.skips")


def test_a_skip_fails_a_session_that_forbids_skips(pytester, monkeypatch):
    monkeypatch.setenv(skips.NO_SKIPS, "1")
    result = _session(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*::test_skips: peft is not installed (NOT EXPECTED: this session fails)"])


def test_an_expected_skip_is_listed_with_its_reason_and_passes(pytester, monkeypatch):
    monkeypatch.setenv(skips.NO_SKIPS, "1")
    monkeypatch.setitem(skips.EXPECTED_SKIPS, "peft is not installed", "no session here is meant to have peft")
    result = _session(pytester)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*::test_skips: peft is not installed (expected: no session here is meant to have "
                                 "peft)"])


def test_without_the_variable_a_skip_is_listed_and_allowed(pytester, monkeypatch):
    monkeypatch.delenv(skips.NO_SKIPS, raising=False)
    result = _session(pytester)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*::test_skips: peft is not installed (allowed outside nox)"])
