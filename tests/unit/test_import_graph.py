"""The house plan's import rules (docs/architecture.md), read from the source: no circles, one
direction.

Top down: ``cli`` and the app factory; ``gateway`` (HTTP, routes, backends); ``serving`` (the
serving core's decisions, below HTTP: which models give way, where an adapter is looked for);
``plan`` (what an engine will run and whether it can: decided before it runs); ``adapters``
(intake, store, manager) above ``base_model`` (resolving the model to serve: the intake reads
a Vi run's layout and a base config from it, and it imports nothing of the adapters), both
above ``fetching`` (what both fetch with: the hub, where a download may connect, progress
records, JSON files), which imports only the leaves; ``supervisor`` (running one engine's
processes), which imports none of them. No two top-level packages import each other, however
far round. The configuration leaves (the ``settings``
package, importing only each other and ``engine_flags``, ``model_names``, ``paths``,
``http.addresses``), the ``http`` package, ``logs`` and ``periodic`` import nothing else of
loragate; ``demo`` may use the base model and the supervisor, not the gateway or the plan; the
engine plugin is a leaf that no other part imports; the installed package never imports the
checkout's ``tools``. Every import counts, ``if TYPE_CHECKING:`` ones too
(``tests/import_graph.py``).
"""

from __future__ import annotations

import ast

from tests.import_graph import CONFIG, GRAPH, LEAVES, MODULES, part


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The nodes of ``graph`` that reach each other, in groups (Tarjan's strongly connected
    components of more than one node)."""
    found = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node] & graph.keys():
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_there_are_no_import_cycles_in_loragate() -> None:
    assert circles({module: GRAPH[module] & MODULES.keys() for module in MODULES}) == []


def test_no_two_top_level_packages_import_each_other() -> None:
    """A circle between packages (``adapters`` and ``base_model`` once) is a circle between
    modules in waiting: neither can be read, tested or moved without the other."""
    packages: dict[str, set[str]] = {part(module): set() for module in MODULES}
    for module, targets in GRAPH.items():
        packages[part(module)] |= {part(t) for t in targets if t in MODULES} - {part(module)}
    assert circles(packages) == []
    assert "loragate.fetching" in packages["loragate.base_model"]  # the rule reads real imports


BELOW_THE_GATEWAY = {"loragate.gateway", "loragate.cli"}
FORBIDDEN = {
    "loragate.serving": BELOW_THE_GATEWAY,
    "loragate.plan": BELOW_THE_GATEWAY,
    "loragate.adapters": BELOW_THE_GATEWAY | {"loragate.plan"},
    "loragate.base_model": BELOW_THE_GATEWAY
    | {"loragate.plan", "loragate.adapters", "loragate.demo"},
    "loragate.supervisor": BELOW_THE_GATEWAY
    | {"loragate.plan", "loragate.adapters", "loragate.base_model", "loragate.demo"},
    "loragate.demo": BELOW_THE_GATEWAY | {"loragate.plan", "loragate.adapters"},
    "loragate.engine_plugin": BELOW_THE_GATEWAY
    | {"loragate.plan", "loragate.adapters", "loragate.base_model", "loragate.supervisor"},
}


def test_imports_go_down_gateway_plan_adapters_base_model_supervisor_never_back() -> None:
    wrong = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if part(target) in FORBIDDEN.get(part(module), set())
    )
    assert wrong == []


def test_fetching_is_below_the_adapters_and_the_base_model_and_takes_only_the_leaves() -> None:
    fetching = {m for m in MODULES if part(m) == "loragate.fetching"}
    assert {
        (m, t) for m in fetching for t in GRAPH[m] if part(t) != part(m) and leaf_of(t) is None
    } == set()
    users = {part(m) for m, targets in GRAPH.items() if targets & fetching} - {"loragate.fetching"}
    assert {"loragate.adapters", "loragate.base_model"} <= users  # what both fetch with


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
    assert "loragate.adapters.manager" in GRAPH["loragate.serving.model"]
    assert "loragate.supervisor.engine" in GRAPH["loragate.adapters.manager"]


def test_the_http_layer_reaches_engines_and_adapters_only_through_the_serving_core() -> None:
    """Nothing under ``gateway/`` imports the supervisor or the adapter manager: a model's
    engine and adapters are the serving core's (``serving.model``, ``serving.catalog``), which
    raises domain errors that the managed backend answers as OpenAI errors. Of the adapter
    layer the gateway reads only its value types (an operation's error, the counters, a
    preset)."""
    gateway = {m for m in MODULES if part(m) == "loragate.gateway"}
    values = {"loragate.adapters.errors", "loragate.adapters.stats", "loragate.adapters.preset"}
    wrong = {
        (m, t)
        for m in gateway
        for t in GRAPH[m]
        if part(t) == "loragate.supervisor" or (part(t) == "loragate.adapters" and t not in values)
    }
    assert wrong == set()
    assert "loragate.serving.catalog" in GRAPH["loragate.gateway.backends.managed"]


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


def probes_in(source: str) -> list[str]:
    """Each ``getattr`` and ``hasattr`` in ``source``, but those on a ``response``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and not (
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "response"
            )
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_routes_ask_a_backend_only_what_its_declared_interfaces_say() -> None:
    """A route calls what ``GatewayBackend`` declares, and what only some backends do after
    ``isinstance`` with one of ``gateway.backends.base``'s protocols: never a method probed by
    name (``getattr``, ``hasattr``), which a rename turns into a feature silently gone. A
    ``response`` may be probed: a Starlette stream has no ``body``."""
    routes = sorted(m for m in MODULES if m.startswith("loragate.gateway.routes."))
    assert len(routes) >= 5
    found = {m: probes_in(MODULES[m].read_text()) for m in routes}
    assert {m: probes for m, probes in found.items() if probes} == {}
    assert len(probes_in("getattr(gateway.backend, 'relay', None)\nhasattr(backend, 'x')")) == 2
