"""How pytest-xdist hands the suite's tests to its workers (tests/conftest.py; docs/testing.md, 'Parallel workers').

A test at a time, as `--dist load` does, except for the modules that build something once for all their tests
(a module-scoped fixture): all of such a module's tests go to one worker, together, so it is built once.

xdist's own way to say that, the `xdist_group` marker with `--dist loadgroup`, does nothing with pytest 9.2 and
xdist 3.8: xdist writes the group into `item._nodeid`, which pytest 9.2 no longer reads, so the group's tests
were spread over both workers and the comparison's module fixture ran twice (125 s). This scheduler groups by
the module's path instead, which both versions agree on.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# Every test module with a module- or session-scoped fixture; tests/test_suite_budget.py checks that none is left out.
ONE_WORKER_MODULES = frozenset({"tests/test_compare.py", "tests/test_install.py"})


def module_of(nodeid: str) -> str:
    """The test file of a node id: 'tests/test_compare.py::test_x[1]' -> 'tests/test_compare.py'."""
    return nodeid.split("::", 1)[0]


class OneWorkerPerSharedModule(LoadScopeScheduling):
    """Each test is its own unit of work, but a module of ONE_WORKER_MODULES is one unit.

    LoadScopeScheduling hands out the largest units first, so those modules start at once, and then every
    other test one by one in the order collected, each to whichever worker is free."""

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return module if module in ONE_WORKER_MODULES else nodeid
