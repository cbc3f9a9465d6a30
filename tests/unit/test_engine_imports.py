"""Only the engine composes: no module of service/engine imports a module that imports it back,
directly or through others, type-only imports included (grimp's graph keeps them)."""

from __future__ import annotations

import grimp


def test_no_engine_module_imports_a_module_that_imports_it_back():
    graph = grimp.build_graph("service", "models")  # type-only (TYPE_CHECKING) imports included
    engine = sorted(m for m in graph.modules if m == "service.engine" or m.startswith("service.engine."))
    assert "service.engine.core" in engine and "service.engine.runner" in engine  # the graph is the real one
    cycles = [
        (module, imported)
        for module in engine
        for imported in sorted(graph.find_modules_directly_imported_by(module))
        if graph.chain_exists(imported, module)
    ]
    assert cycles == [], [graph.find_shortest_chain(b, a) for a, b in cycles]


def test_the_engine_imports_no_layer_above_it():
    graph = grimp.build_graph("service", "models")
    for layer in ("service.api", "service.process", "service.bench", "service.offline"):
        assert not graph.chain_exists("service.engine", layer, as_packages=True), layer


def test_the_engines_parts_import_neither_the_engine_nor_one_another():
    """The runner, the prefiller and the speculator are composed by the engine alone: none of
    them reaches the engine, and none reaches another (a draft's chunk plan is a pure function
    of the prefill module, not the prefiller)."""
    graph = grimp.build_graph("service", "models")
    parts = {
        "service.engine.runner": ("service.engine.prefill", "service.engine.speculative"),
        "service.engine.prefill": ("service.engine.runner", "service.engine.speculative"),
        "service.engine.speculative": ("service.engine.runner",),
        "service.engine.batch": ("service.engine.runner", "service.engine.prefill", "service.engine.speculative"),
        "service.engine.prefix_cache": ("service.engine.runner", "service.engine.prefill", "service.engine.batch"),
    }
    for part, others in parts.items():
        for other in ("service.engine.core", *others):
            assert not graph.chain_exists(part, other), graph.find_shortest_chain(part, other)
