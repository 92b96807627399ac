"""The package's import layers (docs/ARCHITECTURE.md, "Layers") and a clean `ruff check`.

Every module under dschat/ is parsed with `ast` (nothing is imported or executed) and each
import, function-level ones included, is checked against the layer order: a module may
import its own layer and the layers below it, never one above, and never the top-level
folders (training/, inference/, applications/, benchmarks/, tests/).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dschat"

# lowest first; a module belongs to the first prefix that names it or a package above it
LAYERS: list[tuple[str, ...]] = [
    ("dschat", "dschat.utils"),               # errors, logging, metrics, dist, tensor_ops, checkpoint, run
    ("dschat.registry", "dschat.data"),       # model-family facts; datasets, formats, collators
    ("dschat.engine",),                       # DeepSpeed training glue: configs, optimizers, ZeRO helpers, epoch loop
    ("dschat.rollout",),                      # ZeRO-3 -> replica gather, hybrid actor, fast decode + kernels, TP
    ("dschat.models",),                       # HF model creation, LoRA, the reward model
    ("dschat.rlhf", "dschat.tasks"),          # PPO / critic-free / DPO training; verifiable tasks
    ("dschat.cli", "dschat.plot"),            # entry points' flags and their validation; plotting CLI
]
TOP_LEVEL_FOLDERS = ("training", "inference", "applications", "benchmarks", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """Index of `module`'s layer: the longest matching prefix wins (dschat.utils over dschat)."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imported_modules(tree: ast.Module, module: str, is_package: bool, known: set[str]):
    """(line, imported module) for every import in the tree, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from dschat import engine` imports the subpackage dschat.engine
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            for name in subs or [target]:
                yield node.lineno, name


def dschat_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def layer_violations() -> list[str]:
    paths = dschat_modules()
    known = {module_name(p) for p in paths}
    problems = []
    for path in paths:
        module = module_name(path)
        mine = layer_of(module)
        if mine is None:
            problems.append(f"{module}: no layer; add its package to LAYERS in tests/test_layers.py "
                            "and to docs/ARCHITECTURE.md")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imported_modules(tree, module, path.name == "__init__.py", known):
            where = f"{path.relative_to(REPO)}:{line}"
            top = target.split(".")[0]
            if top in TOP_LEVEL_FOLDERS:
                problems.append(f"{where}: {module} imports {target}: dschat never imports the "
                                f"top-level folder {top}/")
            elif top == "dschat":
                theirs = layer_of(target)
                if theirs is not None and theirs > mine:
                    problems.append(f"{where}: {module} (layer {mine}: {', '.join(LAYERS[mine])}) imports "
                                    f"{target} (layer {theirs}: {', '.join(LAYERS[theirs])}), an upward import")
    return problems


def test_no_module_imports_a_higher_layer():
    problems = layer_violations()
    assert not problems, "import layers broken:\n  " + "\n  ".join(problems)


def test_the_checker_sees_upward_and_function_level_imports(tmp_path, monkeypatch):
    """A function-level upward import and a relative one are both reported, with file and line."""
    pkg = tmp_path / "dschat"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "rlhf").mkdir()
    for init in (pkg / "__init__.py", pkg / "utils" / "__init__.py", pkg / "rlhf" / "__init__.py"):
        init.write_text("")
    (pkg / "rlhf" / "ppo.py").write_text("X = 1\n")
    (pkg / "utils" / "bad.py").write_text("import os\n\n\ndef f():\n    from dschat.rlhf.ppo import X\n    return X\n")
    (pkg / "utils" / "rel.py").write_text("from ..rlhf import ppo\nimport inference.common\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    problems = layer_violations()
    assert any(p.startswith("dschat/utils/bad.py:5: dschat.utils.bad") and "dschat.rlhf.ppo" in p
               and "upward" in p for p in problems), problems
    assert any(p.startswith("dschat/utils/rel.py:1:") and "dschat.rlhf.ppo" in p for p in problems), problems
    assert any(p.startswith("dschat/utils/rel.py:2:") and "top-level folder inference/" in p for p in problems)


def test_every_dschat_package_has_a_layer():
    assert all(layer_of(module_name(p)) is not None for p in dschat_modules())


@pytest.mark.skipif(shutil.which("ruff") is None,
                    reason="ruff not installed (pip install -r requirements-dev.txt installs it)")
def test_ruff_check_is_clean():
    proc = subprocess.run(["ruff", "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
