"""The house plan's import rules (docs/architecture.md), read from the source: no circles, one
direction.

Top down: ``cli`` and the app factory; ``gateway`` (HTTP, routes, backends); ``plan`` (what an
engine will run and whether it can: decided before it runs); ``adapters`` (intake, store,
manager) and ``base_model`` (resolving the model to serve; it fetches through the adapters'
intake sources and progress records, and the intake reads a Vi run's layout and a base config
from it: siblings, without a module circle); ``supervisor`` (running one engine's processes),
which imports none of them. The configuration leaves (the ``settings`` package, importing only
each other and ``engine_flags``, ``model_names``, ``paths``, ``http.addresses``), the ``http``
package and ``logs`` import nothing else of loragate; ``demo`` may use the base model and the
supervisor, not the gateway or the plan; the engine plugin is a leaf that no other part
imports; the installed package never imports the checkout's ``tools``. Every import counts,
``if TYPE_CHECKING:`` ones too (``tests/import_graph.py``).
"""

from __future__ import annotations

from tests.import_graph import CONFIG, GRAPH, LEAVES, MODULES, part


def test_there_are_no_import_cycles_in_loragate() -> None:
    cycles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH[module] & MODULES.keys():
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert cycles == []


BELOW_THE_GATEWAY = {"loragate.gateway", "loragate.cli"}
FORBIDDEN = {
    "loragate.plan": BELOW_THE_GATEWAY,
    "loragate.adapters": BELOW_THE_GATEWAY | {"loragate.plan"},
    "loragate.base_model": BELOW_THE_GATEWAY | {"loragate.plan", "loragate.demo"},
    "loragate.supervisor": BELOW_THE_GATEWAY
    | {"loragate.plan", "loragate.adapters", "loragate.base_model", "loragate.demo"},
    "loragate.demo": BELOW_THE_GATEWAY | {"loragate.plan", "loragate.adapters"},
    "loragate.engine_plugin": BELOW_THE_GATEWAY
    | {"loragate.plan", "loragate.adapters", "loragate.base_model", "loragate.supervisor"},
}
# What the base model may take from the adapters' side: fetching and its progress records.
BASE_MODEL_USES = ("loragate.adapters.intake.sources", "loragate.adapters.progress",
                   "loragate.adapters.json_file")  # fmt: skip


def test_imports_go_down_gateway_plan_adapters_base_model_supervisor_never_back() -> None:
    wrong = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if part(target) in FORBIDDEN.get(part(module), set())
    )
    assert wrong == []


def test_the_base_model_takes_only_fetching_from_the_adapters() -> None:
    taken = {
        (module, target)
        for module, targets in GRAPH.items()
        if part(module) == "loragate.base_model"
        for target in targets
        if part(target) == "loragate.adapters"
    }
    assert {(m, t) for m, t in taken if not t.startswith(BASE_MODEL_USES)} == set()
    assert taken  # the rule reads real imports


def test_the_supervisor_runs_processes_it_is_not_told_about_plans() -> None:
    """``supervisor`` gets a command and timings; what to run is ``plan``'s."""
    supervisor = {m for m in MODULES if part(m) == "loragate.supervisor"}
    assert len(supervisor) <= 14, sorted(supervisor)  # about a dozen rooms
    plan = {m for m in MODULES if part(m) == "loragate.plan"}
    assert "loragate.plan.preflight" in plan and "loragate.plan.engine_plan" in plan


def leaf_of(module: str) -> str | None:
    """The leaf (a module, or a package with its modules) that ``module`` belongs to."""
    return next((leaf for leaf in LEAVES if module == leaf or module.startswith(leaf + ".")), None)


def test_the_configuration_and_the_leaves_import_nothing_above_them() -> None:
    config = {module for module in MODULES if part(module) == CONFIG}
    assert {
        (m, t) for m in config for t in GRAPH[m] if leaf_of(t) is None and t not in config
    } == set()
    outside = {
        module: {t for t in targets if leaf_of(t) != leaf_of(module)}
        for module, targets in GRAPH.items()
        if leaf_of(module) is not None
    }
    assert {module: targets for module, targets in outside.items() if targets} == {}
    assert "loragate.http.wire" in GRAPH["loragate.http.pool"]  # the package's modules are seen


def test_nothing_imports_the_cli_the_engine_plugin_or_the_checkouts_tools() -> None:
    # `python -m loragate` (loragate/__main__.py) is the CLI under the Vi server's module name.
    cli_users = [m for m, targets in GRAPH.items() if "loragate.cli" in targets]
    assert cli_users in ([], ["loragate.__main__"]), cli_users
    cli_parts = {m for m in MODULES if m.startswith("loragate.cli_")}  # cli_serve, cli_admin...
    cli = cli_parts | {"loragate.cli"}
    assert [m for m, targets in GRAPH.items() if targets & cli_parts and m not in cli] == []
    plugin_users = [
        m
        for m, targets in GRAPH.items()
        if part(m) != "loragate.engine_plugin"
        and any(part(t) == "loragate.engine_plugin" for t in targets)
    ]
    assert plugin_users == []
    assert [m for m, targets in GRAPH.items() if "tools" in targets] == []
    app_users = {m for m, targets in GRAPH.items() if "loragate.gateway.app" in targets}
    assert app_users <= {"loragate.cli_serve", "loragate"}, app_users


def test_the_graph_is_read_at_all() -> None:
    # A parser that found nothing would pass every rule above.
    assert len(MODULES) > 80
    assert "loragate.adapters.manager" in GRAPH["loragate.gateway.backends.supervised"]
    assert "loragate.supervisor.engine" in GRAPH["loragate.adapters.manager"]


def test_routes_reach_the_engine_and_adapters_only_through_a_backend() -> None:
    """Routes see a backend's interfaces (``gateway.backends.base``), never its parts: nothing of
    the adapter layer, the supervisor, the plan or the base model; and only the app (and the
    hot path, which calls the inference endpoints) imports a route."""
    below = {"loragate.adapters", "loragate.supervisor", "loragate.plan", "loragate.base_model"}
    routes = {m for m in MODULES if m.startswith("loragate.gateway.routes")}
    assert {(m, t) for m in routes for t in GRAPH[m] if part(t) in below} == set()
    route_users = {m for m, targets in GRAPH.items() if targets & routes} - routes
    assert route_users <= {"loragate.gateway.app", "loragate.gateway.server.hot_routes"}, (
        route_users
    )
