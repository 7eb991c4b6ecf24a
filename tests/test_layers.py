"""The layer order of docs/architecture.md holds: every module imports only its own layer and the
layers listed before it (function-level and TYPE_CHECKING imports included), read with `ast`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "paratrain"

# Bottom first, as docs/architecture.md lists them; node.py and __init__.py are the top.
LAYERS = [
    ("version", "errors", "system"),
    ("transport",),
    ("compression",),
    ("cluster",),
    ("data",),
    ("metrics",),
    ("checkpoint",),
    ("kvstore",),
    ("collective",),
    ("pipeline",),
    ("train",),
    ("serve",),
    ("integrations",),
    ("launch",),
    ("testing_hosts", "testing"),
    ("node", "__init__", "__main__"),
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """`paratrain.kvstore.worker.client` -> "kvstore"; the package root is "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every paratrain module `path` imports, at any depth of the file."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from paratrain import kvstore` imports paratrain.kvstore
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if is_module(full) else base))
    return [(line, name) for line, name in found if name == "paratrain" or name.startswith("paratrain.")]


def test_every_layer_is_known() -> None:
    for path in PACKAGE.iterdir():
        if path.name.startswith((".", "_")) and path.name != "__init__.py" or path.name == "py.typed":
            continue
        assert path.stem in LEVEL, f"{path.name} is in no layer: add it to LAYERS and docs/architecture.md"


def test_no_import_reaches_up() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = layer_of(module_name(path))
        for line, target in imported(path):
            theirs = layer_of(target)
            if LEVEL[theirs] > LEVEL[mine]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "imports that reach up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import paratrain", ["paratrain"]),
        ("from paratrain import kvstore", ["paratrain.kvstore"]),
        ("from paratrain import __version__", ["paratrain"]),
        ("def f():\n    from paratrain.node import init", ["paratrain.node"]),
    ],
)
def test_the_walk_sees_every_import(source: str, expected: list[str]) -> None:
    path = PACKAGE / "data" / "probe.py"  # a module's place in the package; never read or written
    assert [name for _, name in imported(path, source)] == expected


def test_subpackages_work_after_a_bare_import() -> None:
    """MXNet users write `mx.kv.create(...)` after `import mxnet`: the same here, in a fresh process
    (and reaching the kvstore's contract imports no torch, so `paratrain launch` starts fast)."""
    code = (
        "import sys, paratrain\n"
        "config = paratrain.kvstore.KVStoreConfig(consistency='bounded', staleness=1)\n"
        "assert callable(paratrain.kvstore.create) and config.policy.min_version(3) == 2\n"
        "assert 'torch' not in sys.modules, 'the kvstore contract imported torch'\n"
        "print(paratrain.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    env = {k: v for k, v in env.items() if not k.startswith(("PARATRAIN_", "DMLC_", "TF_CONFIG"))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == paratrain.__version__
    assert paratrain.pipeline.PipelineConfig(stages=2).stages == 2  # and the others, in this process
    assert str(paratrain.train.Strategy.parse("dist_async").consistency) == "async"
