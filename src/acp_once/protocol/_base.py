"""The base classes of the generated wire models.

The schema has ~350 models; building every validator when `acp_once.protocol.schema` is
imported took ~0.5 s of each agent process's start, most of it for unions of every message
that a process never validates. `defer_build` builds a model's validator the first time it is
used instead: the same validator, later. Subclasses merge their own `model_config` with this.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, RootModel

__all__ = ["WireModel", "WireRootModel"]

_Root = TypeVar("_Root")


class WireModel(BaseModel):
    """A generated wire model: a pydantic model whose validator is built on first use."""

    model_config = ConfigDict(defer_build=True)


class WireRootModel(RootModel[_Root]):
    """A generated root model (a union, a list, a scalar): built on first use. Parametrizing
    it (`WireRootModel[X]`) keeps `defer_build`, where `RootModel[X]` would build `X` at once."""

    model_config = ConfigDict(defer_build=True)
