"""The architecture diagram draws exactly the import-linter layers, and the source tree block
names exactly the packages those layers place.

docs/architecture.md draws the layers contract of pyproject.toml as a mermaid graph: one node
per layer (its label starts with the layer as the contract writes it, `a | b` for independent
packages), one arrow from each layer to the next lower one, and no other arrow. A layer added,
removed or moved in the contract, or an arrow drawn that the contract does not have, fails here.
"""

from __future__ import annotations

import re
import tomllib
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYERS_CONTRACT = "Layers point downward"

_NODE = re.compile(r'^\s*(\w+)\["([^"]+)"\]\s*$')
_ARROW = re.compile(r"^\s*(\w+)\s*-->\s*(\w+)\s*$")


def contract_layers() -> list[frozenset[str]]:
    """The layers of the contract, top first, each as the set of its packages."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and LAYERS_CONTRACT in c["name"]]
    assert layers["containers"] == ["acp_once"] and layers["exhaustive"] is True
    return [parse_layer(layer) for layer in layers["layers"]]


def parse_layer(text: str) -> frozenset[str]:
    """`"agent | client"` -> {"agent", "client"}."""
    return frozenset(part.strip() for part in text.split("|"))


def mermaid(text: str) -> tuple[dict[str, frozenset[str]], list[tuple[str, str]]]:
    """The one mermaid block of `text`: its nodes (id -> the layer its label names) and arrows."""
    blocks = re.findall(r"^```mermaid\n(.*?)^```$", text, re.M | re.S)
    assert len(blocks) == 1, f"expected one mermaid block, found {len(blocks)}"
    nodes: dict[str, frozenset[str]] = {}
    arrows: list[tuple[str, str]] = []
    for line in blocks[0].splitlines():
        if node := _NODE.match(line):
            assert node.group(1) not in nodes, f"node {node.group(1)} drawn twice"
            nodes[node.group(1)] = parse_layer(node.group(2).split(":", 1)[0])
        elif arrow := _ARROW.match(line):
            arrows.append((arrow.group(1), arrow.group(2)))
        else:
            assert line.strip() in ("", "graph TD"), f"a line this test cannot read: {line!r}"
    return nodes, arrows


def test_every_layer_has_one_node_and_every_node_is_a_layer() -> None:
    layers = contract_layers()
    nodes, _ = mermaid(ARCHITECTURE.read_text(encoding="utf-8"))
    drawn = sorted(sorted(n) for n in nodes.values())
    assert drawn == sorted(sorted(layer) for layer in layers)


def test_the_arrows_are_exactly_the_steps_down_the_layers() -> None:
    layers = contract_layers()
    nodes, arrows = mermaid(ARCHITECTURE.read_text(encoding="utf-8"))
    assert set(nodes) >= {a for arrow in arrows for a in arrow}, "an arrow to an undrawn node"
    drawn = [(nodes[a], nodes[b]) for a, b in arrows]
    allowed = list(pairwise(layers))
    assert len(drawn) == len(set(drawn)), "an arrow drawn twice"
    for upper, lower in drawn:
        assert (upper, lower) in allowed, (
            f"{' | '.join(sorted(upper))} --> {' | '.join(sorted(lower))} "
            "is not a step from a layer to the next lower one"
        )
    assert set(drawn) == set(allowed), "a step down the layers is not drawn"


def test_the_source_tree_block_names_every_package_the_layers_place() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = re.search(r"^```\nsrc/acp_once/\n(.*?)^```$", text, re.M | re.S)
    assert block is not None, "the source tree block of docs/architecture.md is gone"
    listed = {
        m.group(1).removesuffix(".py") for m in re.finditer(r"^  (\S+?)/?\s", block.group(1), re.M)
    }
    placed = set().union(*contract_layers())
    assert listed == placed
    # and the layers place what is there (import-linter checks it too: the contract is exhaustive)
    package = ROOT / "src" / "acp_once"
    present = {
        p.name.removesuffix(".py")
        for p in package.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert present == placed


def test_a_wrong_arrow_is_caught() -> None:
    layers = contract_layers()
    text = ARCHITECTURE.read_text(encoding="utf-8").replace(
        "    rpc --> protocol\n", "    rpc --> protocol\n    apps --> cli\n"
    )
    nodes, arrows = mermaid(text)
    allowed = set(pairwise(layers))
    assert any((nodes[a], nodes[b]) not in allowed for a, b in arrows)
