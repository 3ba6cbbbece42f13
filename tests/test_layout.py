"""The package's layout rules: no import cycle (lazy imports count), old paths keep importing, one home."""

import ast
import json
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cwcore"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every cwcore module ``path`` imports, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "cwcore"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cwcore":
                continue
            modules = {f"{target}.{a.name}" for a in node.names}
            found |= {m for m in modules if m in MODULES} or {target}
    return {m for m in found if m in MODULES and m != name}


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_no_import_cycle_inside_cwcore():
    graph = {name: _imports(path) for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_source_file_is_much_over_800_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 850}
    assert not long, f"split these modules: {long}"


@pytest.mark.parametrize("old", ["cwcore.attention", "cwcore.decomposition", "cwcore.geometry",
                                 "cwcore.architectures", "cwcore.interventions", "cwcore.ranking",
                                 "cwcore.sink_claims", "cwcore.findings", "cwcore.notebook", "cwcore.book"])
def test_old_module_paths_are_gone(old):
    """The first layout's module paths no longer import (no import hook keeps them): CHANGELOG names each new home."""
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert old in (PACKAGE.parent / "CHANGELOG.md").read_text()


def test_top_level_names_resolve():
    import cwcore

    for name in cwcore.__all__:
        assert getattr(cwcore, name) is not None, name
    assert cwcore.faithfulness_curve is __import__("cwcore.faithfulness", fromlist=["x"]).faithfulness_curve


def test_the_top_level_holds_the_users_verbs_and_the_engine_stays_in_its_modules():
    import importlib
    import types

    import cwcore

    assert set(cwcore.__all__) == {
        "load_model", "load_dataset", "PACKAGED_MODELS", "PACKAGED_DATASETS", "decompose", "Decomposition",
        "summarize", "intervene", "attribute", "list_attribution_methods", "faithfulness_curve", "aopc", "sinks",
        "UnsupportedModelError", "register_output_projection"}
    assert isinstance(cwcore.sinks, types.ModuleType) and cwcore.sinks.__name__ == "cwcore.sinks"
    engine = {"AttentionSession": "core.attention", "LayerCall": "core.attention", "METRICS": "core.decomposition",
              "attention_blocks": "core.architectures", "prepare_inputs": "core.decomposition",
              "decomposable_layers": "core.architectures"}
    for name, home in engine.items():
        assert name not in dir(cwcore), name
        with pytest.warns(DeprecationWarning, match=rf"cwcore.{name} is deprecated: use cwcore.{home}.{name}"):
            old = getattr(cwcore, name)
        assert old is getattr(importlib.import_module(f"cwcore.{home}"), name)


def _delegates(node: ast.FunctionDef) -> bool:
    """A compatibility wrapper: its body (after the docstring) is one ``return stats.f(...)``/``runs.f(...)``."""
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return False
    func = body[0].value.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("stats", "runs")


def test_one_fingerprint_one_bootstrap_family():
    """Helpers with one purpose exist once: the names below are implemented in one module only (other
    modules may keep an old name as a one-line wrapper that calls the one implementation)."""
    defined: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and not _delegates(node):
                defined.setdefault(node.name, []).append(_module_name(path))
    for name in ("model_fingerprint", "_fingerprint", "bootstrap_ci", "_bootstrap_indices", "_mean_ci",
                 "spearman_ci", "share_ci", "verdict", "combine_verdicts", "_hub_reachable", "_hub_offline",
                 "sequence_bootstrap", "cluster_bootstrap", "wilson_ci", "tensor_digest", "_digest", "_tensor_digest"):
        homes = defined.get(name, [])
        assert len(homes) <= 1, f"{name} is defined in {homes}"


def test_committed_notebooks_are_valid_nbformat_without_outputs():
    # a cell without an id is a warning of nbformat today (printed into every build) and an error later
    import nbformat

    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        raw = json.loads(path.read_text())  # nbformat.read would add the missing ids itself
        missing = [i for i, cell in enumerate(raw["cells"]) if "id" not in cell]
        nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
        nbformat.validate(nb)
        assert not missing, f"{path.name}: cells {missing} have no id"
        stored = [i for i, cell in enumerate(nb.cells) if cell.get("outputs")]
        assert not stored, f"{path.name}: cells {stored} are committed with outputs"


def _undisplayed_tables(source: str) -> list[int]:
    """Lines of ``show(...)`` calls whose table is never displayed: a bare expression statement that is not
    the cell's last top-level statement (a Styler is shown only as the cell's value or through display)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: not Python
        return []
    last = tree.body[-1] if tree.body else None
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "show" and node is not last]


def test_every_table_a_notebook_shows_is_displayed():
    assert _undisplayed_tables("if x:\n    show(a)\nelse:\n    pass\n") == [2]  # the check can fail
    assert _undisplayed_tables("show(a)\nprint(1)\n") == [1]
    assert _undisplayed_tables("x = 1\nshow(a)\n") == [] and _undisplayed_tables("display(show(a))\nx = 1\n") == []
    found = {}
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                lines = _undisplayed_tables("".join(cell["source"]))
                if lines:
                    found[f"{path.name}:{cell.get('id')}"] = lines
    assert not found, f"show(...) whose table is never displayed (wrap it in display): {found}"


#: Names of a model's internals: its projections and attention modules, its layer lists and the containers that
#: hold them. A notebook reaches a block through cwcore's architecture facts (``attention_blocks(lm)[l]``,
#: ``.output_module()``, ``decomposable_layers`` of ``cwcore.core.architectures``), which work for every layout, never by one family's names.
INTERNAL_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "c_proj", "out_proj", "Wqkv", "Wo",
                  "self_attn", "self_attention", "attn", "embed_tokens", "lm_head"}
LAYER_LISTS = {"layers", "layer", "h", "blocks"}
CONTAINERS = {"model", "base_model", "transformer", "encoder", "decoder", "gpt_neox", "language_model", "text_model",
              "vision_model"}
_MODEL_MAKERS = ("load_model", "from_pretrained", "from_config")


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _model_names(trees) -> set[str]:
    """Names bound to a model: ``lm, tok = cwcore.load_model(...)``, ``vit = ViTModel(config).eval()``, ..."""
    names = {"lm"}
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            calls = [getattr(c.func, "attr", getattr(c.func, "id", "")) for c in ast.walk(node.value)
                     if isinstance(c, ast.Call)]
            if any(c in _MODEL_MAKERS or c.endswith("Model") or "For" in c for c in calls):
                for target in node.targets:
                    first = target.elts[0] if isinstance(target, ast.Tuple) else target
                    names |= {first.id} if isinstance(first, ast.Name) else set()
    return names


def _internal_reaches(sources: list[str]) -> list[str]:
    """Where cells (of one notebook: they share names) reach model internals by attribute name, or count the
    attention blocks instead of the decomposable layers: ``["<cell>:<line>: <why>"]``."""
    trees = [ast.parse("\n".join(l for l in s.splitlines() if not l.lstrip().startswith(("%", "!")))) for s in sources]
    models, found = _model_names(trees), []
    for cell, tree in enumerate(trees):
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            name = base = None
            if isinstance(node, ast.Attribute):
                name, base = node.attr, node.value
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                name, base = node.args[1].value, node.args[0]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "len" and node.args
                  and isinstance(node.args[0], ast.Call)
                  and getattr(node.args[0].func, "attr", getattr(node.args[0].func, "id", "")) == "attention_blocks"):
                found.append(f"{cell}:{node.lineno}: len(attention_blocks(...)) counts blocks cwcore may not decompose; "
                             "use cwcore.core.architectures.decomposable_layers")
            if name is None:
                continue
            on_model = _root(base) in models
            inside = isinstance(base, ast.Attribute) and base.attr in CONTAINERS
            indexed = isinstance(parents.get(node), ast.Subscript) and isinstance(parents.get(parents[node]), ast.Attribute)
            if (name in INTERNAL_NAMES or (name in CONTAINERS and on_model)
                    or (name in LAYER_LISTS and (on_model or inside or indexed))):
                found.append(f"{cell}:{node.lineno}: .{name}")
    return found


def test_notebooks_reach_model_internals_only_through_cwcore():
    """A notebook that names one family's modules (``lm.model.layers[3].self_attn.o_proj``) breaks on every other
    layout, and one that counts attention blocks asks for blocks cwcore cannot decompose."""
    bad = ["lm.model.layers[0].self_attn.o_proj.weight", "block.module.v_proj(x)", "encoder.encoder.layer[3]",
           "gpt.transformer.h[0]", "x = net.layers[2].mlp", "getattr(attention, 'q_proj')", "lm.model",
           "n_layers = len(cwcore.attention_blocks(lm))", "vit = ViTModel(config).eval()\nvit.encoder"]
    for source in bad:  # the check can fail
        assert _internal_reaches([source]), source
    fine = ["d[d.layers[len(d.layers) // 2]].attention", "d.layers[-1] + 1", "frame.query('layer > 0')",
            "attention_blocks(lm)[3].output_module().weight", "layers = decomposable_layers(lm)",
            "config.num_hidden_layers", "run.blocks", "%matplotlib inline\nx = 1"]
    assert _internal_reaches(fine) == []
    found = {}
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        for where in _internal_reaches(["".join(c["source"]) for c in cells]):
            cell, rest = where.split(":", 1)
            found.setdefault(path.name, []).append(f"{cells[int(cell)].get('id')}:{rest}")
    # the chapters' modules hold the notebooks' computations: the same rule
    for path in sorted((PACKAGE.parent / "book" / "cwbook" / "chapters").glob("*.py")):
        for where in _internal_reaches([path.read_text()]):
            found.setdefault(f"book/cwbook/chapters/{path.name}", []).append(where.split(":", 1)[1])
    assert not found, f"notebooks reaching model internals by name (use cwcore's architecture facts): {found}"


def test_cwcore_reads_no_private_mapping_of_transformers():
    """transformers' private ``_global_mapping`` can change without notice; the model's own forward looks
    attention functions up in the public ``ALL_ATTENTION_FUNCTIONS``, and so does cwcore."""
    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "_global_mapping" in p.read_text()]
    assert users == []
