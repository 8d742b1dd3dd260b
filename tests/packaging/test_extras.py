"""The base install is light: what needs an extra is reached only when asked for, a command
that needs a missing extra names it, and everything `src/` imports is declared.

Each test runs a real interpreter from this environment (every extra installed) in which the
optional packages are blocked (`sys.modules[name] = None`, so importing one raises
ModuleNotFoundError) or watched (`sys.modules` after the imports): that is what a base install
without extras sees. tests/packaging/test_wheel.py checks the same on a real base install.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = [
    "starlette", "uvicorn", "websockets", "httpx", "h11", "psycopg", "psycopg_pool", "uvloop",
    "langgraph", "langchain_core",
]  # fmt: skip
SERVER = ["starlette", "uvicorn", "websockets", "httpx", "h11"]
POSTGRES = ["psycopg", "psycopg_pool"]
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "packaging-test", "version": "1"}},
}


def _cli(blocked: list[str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`acp-once ARGS` in a fresh interpreter where the `blocked` packages cannot be imported."""
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "sys.argv = ['acp-once', *sys.argv[1:]]\n"
        "from acp_once.cli.entry import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_public_api_imports_none_of_the_optional_packages() -> None:
    code = (
        "import sys, json\n"
        "import acp_once, acp_once.agent, acp_once.client, acp_once.storage, acp_once.protocol\n"
        "import acp_once.cli.app, acp_once.conformance, acp_once.testing\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(done.stdout))
    assert "acp_once" in loaded
    assert loaded.isdisjoint(OPTIONAL), sorted(loaded & set(OPTIONAL))


def test_the_reference_agent_answers_initialize_without_any_extra(tmp_path: Path) -> None:
    done = _cli(
        OPTIONAL,
        "agent",
        "--store",
        "memory:",
        "--side-effects",
        str(tmp_path),
        stdin=json.dumps(INITIALIZE) + "\n",
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[0])
    assert answer["id"] == 1
    assert answer["result"]["protocolVersion"] == 2
    assert "Traceback" not in done.stderr


# (the packages blocked, the command, the extra it must name)
NEEDS_AN_EXTRA = [
    (SERVER, ["serve", "--store", "memory:"], "server"),
    (SERVER, ["bridge", "--", "acp-once", "agent"], "server"),
    (SERVER, ["check", "ws://127.0.0.1:9/acp"], "server"),
    (SERVER, ["prompt", "--agent", "http://127.0.0.1:9/acp", "hi"], "server"),
    (SERVER, ["status", "http://127.0.0.1:9"], "server"),
    (["websockets"], ["demo", "--transport", "ws"], "server"),
    (POSTGRES, ["agent", "--store", "postgresql://u@127.0.0.1:9/db"], "postgres"),
    (["psycopg_pool"], ["db", "status", "--store", "postgresql://u@127.0.0.1:9/db"], "postgres"),
]


def test_a_command_that_needs_a_missing_extra_names_it() -> None:
    # One interpreter runs every command in turn (each checks its extra before it starts
    # anything), so the packages blocked change between commands: sys.modules is restored.
    code = (
        "import contextlib, io, json, sys\n"
        "from acp_once.cli.entry import main\n"
        "results = []\n"
        f"for blocked, args, _ in {NEEDS_AN_EXTRA!r}:\n"
        "    saved = {name: sys.modules.pop(name, None) for name in blocked}\n"
        "    sys.modules.update(dict.fromkeys(blocked))\n"
        "    sys.argv, err = ['acp-once', *args], io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            main()\n"
        "        except SystemExit as exit:\n"
        "            code = exit.code\n"
        "        else:\n"
        "            code = 0\n"
        "    for name, module in saved.items():\n"
        "        if module is None: del sys.modules[name]\n"
        "        else: sys.modules[name] = module\n"
        "    results.append([code, err.getvalue()])\n"
        "print(json.dumps(results))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    for (_, args, extra), (code, stderr) in zip(
        NEEDS_AN_EXTRA, json.loads(done.stdout), strict=True
    ):
        assert code == 2, (args, code, stderr)
        assert f"install acp-once[{extra}]" in stderr, (args, stderr)
        assert "Traceback" not in stderr, (args, stderr)


def test_a_missing_extra_met_past_the_checks_is_named_too() -> None:
    # `serve` checks the whole server extra before importing anything; with that check
    # switched off, the import of the blocked `uvicorn` fails inside the command.
    code = (
        "import sys\n"
        "sys.modules['uvicorn'] = None\n"
        "import acp_once.cli.app as cli\n"
        "cli._require = lambda extra, what: None\n"
        "sys.argv = ['acp-once', 'serve', '--store', 'memory:']\n"
        "cli.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "install acp-once[server]" in done.stderr
    assert "missing: uvicorn" in done.stderr


def test_open_store_names_the_postgres_extra_when_psycopg_is_missing() -> None:
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "import anyio\n"
        "from acp_once.storage import open_store\n"
        "async def main() -> None:\n"
        "    async with open_store('postgresql://u@127.0.0.1:9/db'):\n"
        "        pass\n"
        "try:\n"
        "    anyio.run(main)\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.startswith("psycopg "), done.stdout + done.stderr
    assert "pip install 'acp-once[postgres]'" in done.stdout


@pytest.mark.parametrize(
    ("launcher", "url"),
    [("WebSocketLauncher", "ws://127.0.0.1:9/acp"), ("HttpLauncher", "http://127.0.0.1:9/acp")],
)
def test_a_client_only_install_is_told_the_extra_a_network_launcher_needs(
    launcher: str, url: str
) -> None:
    code = (
        "import sys\n"
        f"for name in {SERVER!r}: sys.modules[name] = None\n"
        f"from acp_once.client import AcpClient, {launcher}\n"
        "try:\n"
        f"    {launcher}({url!r})\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.startswith(f"{launcher} needs the server extra (missing: "), done.stdout
    assert done.stdout.strip().endswith("pip install 'acp-once[server]'"), done.stdout


def test_version() -> None:
    done = _cli(OPTIONAL, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"acp-once {importlib.metadata.version('acp-once')}"


def _declared() -> set[str]:
    """Every distribution pyproject.toml declares: the base and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    return {_canonical(re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0]) for spec in specs}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_package_src_imports_is_declared() -> None:
    imported: dict[str, set[str]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                imported.setdefault(name.partition(".")[0], set()).add(path.name)
    third_party = {
        top for top in imported if top not in sys.stdlib_module_names and top != "acp_once"
    }
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    undeclared = {
        top: sorted(imported[top])
        for top in third_party
        if not {_canonical(d) for d in distributions.get(top, [top])} & declared
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert {"anyio", "pydantic", "orjson", "typer", "rich", "h11"} <= third_party


def test_the_pypi_description_shows_the_session_agent_example_verbatim() -> None:
    description = (ROOT / "README-pypi.md").read_text(encoding="utf-8")
    source = (ROOT / "examples" / "session_agent.py").read_text(encoding="utf-8")
    body = source.split('"""', 2)[2].lstrip("\n")
    assert f"# examples/session_agent.py\n{body}" in description, (
        "README-pypi.md (the PyPI description) shows examples/session_agent.py: update it too"
    )
