"""acp-once: the Agent Client Protocol v2 where a prompt is inserted at most once.

`acp_once.__version__` is the installed distribution's version (`0+unknown` when the package
is imported from a source tree that was never installed).
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # Looked up on first use, not at import: reading the distribution's metadata costs about
    # 6 ms, and every agent process imports this package before it can answer `initialize`.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("acp-once")
        except PackageNotFoundError:
            found = "0+unknown"
        globals()["__version__"] = found
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
