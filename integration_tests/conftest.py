"""Integration-test session hooks: the bad-input suite's size (its every-rank cases and its
one-rank cases), printed every run so it can be compared from one version to the next."""

SUITES = {
    "bad_input": ("bad-input suite", "each on every rank: the same clear error, no hang"),
    "bad_input_one_rank": ("bad-input suite, one-rank cases",
                           "the failing rank's error on every rank within 60 s"),
}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for marker, (name, meaning) in SUITES.items():
        reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
                   if r.when == "call" and marker in r.keywords]
        if reports:
            passed = sum(r.passed for r in reports)
            terminalreporter.write_line(f"{name}: {len(reports)} distinct cases, {passed} passed ({meaning})")
