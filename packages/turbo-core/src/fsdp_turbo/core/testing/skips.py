"""A pytest plugin: where the session asks for it, a skipped test fails the session.

A test that skips where it was meant to run has never run: its feature is listed as tested
and nothing tests it. ``nox`` sets ``FSDP_TURBO_NO_SKIPS=1``; any skip then fails the session
(exit status 1), unless its reason is one of ``EXPECTED_SKIPS`` (each says why that skip is
right on the machines nox runs on). Every skip, expected or not, is listed with its reason at
the end of the session's output. Without the variable (a session run by hand) a skip is
listed and allowed. Under xdist the controller decides, from every worker's reports.

Load it with ``pytest_plugins = ["fsdp_turbo.core.testing.skips"]`` in the root ``conftest.py``.
"""

from __future__ import annotations

import os

import pytest

NO_SKIPS = "FSDP_TURBO_NO_SKIPS"
# reason (as the test gives it) -> why that skip is right in a nox session; none today
EXPECTED_SKIPS: dict[str, str] = {}


def _skips(terminalreporter) -> list[tuple[str, str]]:
    """(test id, reason) of every skipped test of the session."""
    found = []
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        found.append((report.nodeid, reason.removeprefix("Skipped: ")))
    return found


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skips = _skips(terminalreporter)
    if not skips:
        return
    enforced = os.environ.get(NO_SKIPS) == "1"
    terminalreporter.section("skips")
    for nodeid, reason in skips:
        verdict = (f"expected: {EXPECTED_SKIPS[reason]}" if reason in EXPECTED_SKIPS
                   else "NOT EXPECTED: this session fails" if enforced else "allowed outside nox")
        terminalreporter.write_line(f"{nodeid}: {reason} ({verdict})")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get(NO_SKIPS) != "1" or hasattr(session.config, "workerinput"):  # the controller decides
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and any(reason not in EXPECTED_SKIPS for _, reason in _skips(reporter)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
