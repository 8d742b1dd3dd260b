"""The model mutants `python3 dev.py verify --mutants` runs (dev.py `MUTANTS`) are the ones the
models define and docs/verification.md lists: a mutant whose `MUTANT_X` is missing from its
model would compile to the model itself and never be caught; one missing from the docs' table
has no stated guard."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("acp_once_dev_list", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_model_mutant_is_defined_in_its_model_and_listed_in_the_docs() -> None:
    dev = _dev()
    files = {name.split("-")[0]: file for name, file, *_ in dev.MODELS}
    docs = (ROOT / "docs" / "verification.md").read_text()
    listed = set(re.findall(r"^\| (\w+) `([A-Z_]+)` \|", docs, re.MULTILINE))
    names = [mutant for _, mutant in dev.MUTANTS]
    assert len(names) == len(set(names)), "a mutant listed twice"
    for model, mutant in dev.MUTANTS:
        text = (ROOT / "verification" / files[model]).read_text()
        assert f"MUTANT_{mutant}" in text, f"{model}/{mutant} is not in {files[model]}"
        assert (model, mutant) in listed, f"{model}/{mutant} has no row in the docs' table"
    assert set(dev.LIVENESS_MUTANTS) <= set(names)


def test_the_cluster_models_sticky_lease_mutants_are_run() -> None:
    dev = _dev()
    cluster = {mutant for model, mutant in dev.MUTANTS if model == "cluster"}
    assert {"KEPT_UNFENCED", "RELEASE_QUEUED", "NO_PICKUP"} <= cluster
    assert "NO_PICKUP" in dev.LIVENESS_MUTANTS
