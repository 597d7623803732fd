"""The shape of the package: what the import-linter contract cannot say.

- No module takes a ``_private`` name, or a name from a ``_private`` module, of another package:
  a name another package needs is public in its home.
- One name per concept: no two public classes of tba share a name.
- The layer order is written once, in pyproject.toml's contract.
"""

from __future__ import annotations

import ast
import collections
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TBA = os.path.join(ROOT, "tba")


def _modules(top: str = TBA):
    """(dotted name, is package, parsed tree) of every module of the package at ``top``."""
    root = os.path.dirname(top)
    for dirpath, dirnames, files in os.walk(top):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                is_pkg = dotted.endswith(".__init__")
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                yield dotted.removesuffix(".__init__"), is_pkg, tree


def package_of(module: str) -> str:
    """The room a module belongs to: tba's subpackage (tba.storage, ...), the subpackage of the
    data path or of decide (tba.datapath.capture, tba.decide.simulator), or a top module."""
    parts = module.split(".")
    depth = 3 if len(parts) > 3 and parts[1] in ("datapath", "decide") else 2
    return ".".join(parts[:depth])


def private_imports(top: str = TBA) -> list[str]:
    found = []
    for module, is_pkg, tree in _modules(top):
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("tba") or package_of(target) == package_of(module):
                continue
            private_module = any(p.startswith("_") for p in target.split(".")[1:])
            names = [a.name for a in node.names]
            private_names = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private_module or private_names:
                found.append(f"{module}:{node.lineno}: from {target} import {', '.join(names)}")
    return found


def test_no_private_name_crosses_a_package():
    assert private_imports() == []


def test_the_check_sees_a_private_import(tmp_path):
    """The scan above is not vacuous: a cross-package private import is reported, one inside
    a package is not."""
    fake = tmp_path / "tba" / "plan"
    fake.mkdir(parents=True)
    (fake / "leak.py").write_text(
        "from ..config.values import _bool\nfrom .shape import _op_spans\n"
        "from tba.storage._native_lib import NativeUnavailable\n"
    )
    assert private_imports(str(tmp_path / "tba")) == [
        "tba.plan.leak:1: from tba.config.values import _bool",
        "tba.plan.leak:3: from tba.storage._native_lib import NativeUnavailable",
    ]


def test_public_class_names_are_distinct():
    where = collections.defaultdict(list)
    for module, _, tree in _modules():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(module)
    assert {name: ms for name, ms in where.items() if len(ms) > 1} == {}


def test_the_layer_order_is_written_once():
    """pyproject.toml's contract names the layers; README and docs point at it instead of
    listing the packages in order again."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        contract = f.read()
    assert '"tba.datapath",\n    "tba.decide | tba.metrics",' in contract
    order = re.compile(r"tba\.datapath\W+tba\.decide\W+(tba\.)?metrics\W+(tba\.)?storage")
    for name in ("README.md", os.path.join("docs", "design.md")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text = f.read()
        assert "[tool.importlinter]" in text, f"{name} does not point at the contract"
        assert not order.search(text), f"{name} writes the layer order out again"
