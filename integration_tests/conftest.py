"""Integration-test session hooks: the bad-input suite's size (its every-rank cases and its
one-rank cases), printed every run so it can be compared from one version to the next."""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
               if r.when == "call" and "bad_input" in r.keywords]
    if reports:
        passed = sum(r.passed for r in reports)
        terminalreporter.write_line(f"bad-input suite: {len(reports)} distinct cases, {passed} passed "
                                    "(each on every rank: the same clear error, no hang)")
    one_rank = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
                if r.when == "call" and "bad_input_one_rank" in r.keywords]
    if one_rank:
        passed = sum(r.passed for r in one_rank)
        terminalreporter.write_line(f"bad-input suite, one-rank cases: {len(one_rank)} distinct cases, {passed} "
                                    "passed (the failing rank's error on every rank within 60 s)")
