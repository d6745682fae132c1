"""The tree's import direction (docs/architecture.md): a static check over every import in
kvserve/ and bench/, and a runtime check that the frontend's and serve's modules load
without torch.

Each package may import the packages listed for it (a prefix matches a module and its
submodules); anything else under `kvserve.` is a violation. Third-party imports are free
except where a package must stay light: torch and transformers are not imported at module
level by the frontend, serve, config, messages or the leaf helpers (a lazy import inside a
function, such as CUDA detection, is left to the runtime check).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LEAF = ("kvserve.wire", "kvserve.paths", "kvserve.procs", "kvserve.sdnotify", "kvserve.metrics",
        "kvserve.config", "kvserve.__init__")
HEAVY = ("torch", "triton", "transformers", "safetensors", "accelerate")

# package -> kvserve modules it may import (besides itself)
ALLOWED: dict[str, tuple[str, ...]] = {
    "kvserve.__init__": (),
    "kvserve.config": (),
    "kvserve.wire": (),
    "kvserve.paths": (),
    "kvserve.procs": (),
    "kvserve.sdnotify": (),
    "kvserve.metrics": (),
    "kvserve.cli": (),  # dispatch only: the subcommands are imported by name at run time
    "kvserve.__main__": ("kvserve.cli",),
    "kvserve.messages": LEAF,
    # memsvc reads the KV shape from the model's header: kvserve.model.files is torch-free
    "kvserve.memsvc": (*LEAF, "kvserve.messages", "kvserve.model.files"),
    "kvserve.kernels": LEAF,
    "kvserve.model": LEAF,
    "kvserve.runner": (*LEAF, "kvserve.messages", "kvserve.memsvc.client", "kvserve.model",
                       "kvserve.kernels"),
    # kvserve.model.grammars (llguidance only) and .tool_parsers are torch-free: the frontend compiles constraints
    "kvserve.frontend": (*LEAF, "kvserve.messages", "kvserve.model.tokenizer", "kvserve.model.files",
                         "kvserve.model.grammars", "kvserve.model.tool_parsers", "kvserve.v1"),
    # the supervisor asks the frontend which runners are live through the public gRPC API
    "kvserve.serve": (*LEAF, "kvserve.v1"),
    "kvserve.tools": (*LEAF, "kvserve.v1", "kvserve.model", "kvserve.messages",
                      "kvserve.memsvc.client"),
    "kvserve.v1": (),
    "bench": ("kvserve",),
}
LIGHT = ("kvserve.config", "kvserve.wire", "kvserve.paths", "kvserve.procs", "kvserve.sdnotify",
         "kvserve.metrics", "kvserve.cli", "kvserve.messages", "kvserve.frontend", "kvserve.serve")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts)


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) of every import in `path`, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        top = id(node) not in lazy
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base in ("kvserve", "") or node.module is None:
                out += [(node.lineno, f"{base}.{a.name}".strip("."), top) for a in node.names]
            else:
                out.append((node.lineno, base, top))
    return out


def _owner(module: str) -> str:
    best = ""
    for pkg in ALLOWED:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _sources() -> list[Path]:
    files = sorted((ROOT / "kvserve").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    return [f for f in files if "_pb2" not in f.name]


def _violations() -> list[str]:
    bad = []
    for path in _sources():
        me = _module_name(path)
        owner = _owner(me)
        assert owner, f"{me} belongs to no package of the layout table"
        for line, mod, top in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {mod}"
            if mod == "tests" or mod.startswith("tests."):
                bad.append(f"{where} (nothing outside tests/ imports the tests)")
            elif mod == "kvserve" or mod.startswith("kvserve."):
                if mod in ("kvserve", "kvserve.__version__") or _owner(mod) == owner or _matches(mod, ALLOWED[owner]):
                    continue
                bad.append(f"{where} (not allowed for {owner})")
            elif top and _matches(me, LIGHT) and mod.split(".")[0] in HEAVY:
                bad.append(f"{where} ({owner} must stay torch-free)")
    return bad


def test_imports_point_one_way() -> None:
    bad = _violations()
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_violation() -> None:
    """The static check is not vacuous: a frontend module importing the runner is caught."""
    rogue = ROOT / "kvserve" / "frontend" / "_layout_probe.py"
    rogue.write_text("import torch\nfrom kvserve.runner import scheduler\nfrom tests import conftest\n")
    try:
        bad = _violations()
    finally:
        rogue.unlink()
    probe = [b for b in bad if "_layout_probe" in b]
    assert len(probe) == 3, probe


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("layout"))


FRONTEND = ["kvserve.frontend.main", "kvserve.frontend.grpc_service", "kvserve.frontend.dispatch",
            "kvserve.frontend.validation", "kvserve.frontend.detok", "kvserve.model.tokenizer"]
LOAD_TOKENIZER = ("from kvserve.model.tokenizer import load_frontend_tokenizer\n"
                  "assert load_frontend_tokenizer('', {model!r}).encode('hello')\n")


@pytest.mark.parametrize(("modules", "then"), [
    (FRONTEND, LOAD_TOKENIZER),  # and load a real model's tokenizer, as the frontend does
    (["kvserve.serve.main", "kvserve.cli", "kvserve.config"], ""),
    (["kvserve.messages.frontend_runner", "kvserve.messages.runner_memsvc", "kvserve.wire"], ""),
])
def test_light_processes_load_without_torch(modules: list[str], then: str, tiny_model: Path) -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) + then.format(model=str(tiny_model))
            + "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{modules} pulled in {out.stdout.strip()}"


MAX_MODULE_LINES = 400
GENERATED = ("generator_pb2.py", "generator_pb2_grpc.py")


def test_every_module_is_under_400_lines() -> None:
    """A module past 400 lines holds several things with names of their own: split it along
    them (docs/architecture.md lists each module)."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "kvserve").rglob("*.py"))
            if p.name not in GENERATED and (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert not long, f"modules of {MAX_MODULE_LINES} lines or more: {long}"


def test_every_module_is_on_the_architecture_map() -> None:
    """docs/architecture.md names every module of kvserve/ (by its path below kvserve/, or its
    file name in a row that names its folder); a package's `__init__.py` that defines nothing
    (a docstring, re-exports) is its folder's."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for p in sorted((ROOT / "kvserve").rglob("*.py")):
        rel = p.relative_to(ROOT / "kvserve")
        if p.name in GENERATED or rel.parts[0] == "v1":
            continue  # the generated stubs and their generator: `kvserve/v1/` in the map
        if p.name == "__init__.py" and not re.search(r"^(?:def|class) ", p.read_text(), re.M):
            continue
        folder = "/".join(rel.parts[:-1])
        rows = [line for line in doc.splitlines() if line.startswith("|")]
        if not any(str(rel) in row or (p.name in row and (not folder or f"{folder}/" in row)) for row in rows):
            missing.append(str(rel))
    assert not missing, f"modules docs/architecture.md does not list: {missing}"


def test_readme_is_short_and_points_at_docs_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250, "README.md: the narratives belong in docs/benchmarks.md"
    for ref in sorted(set(re.findall(r"(?:docs|bench)/[\w.-]+\.md", readme))):
        assert (ROOT / ref).is_file(), f"README.md names {ref}, which does not exist"
