"""Typed errors raised at the engine's edges. Each message names the bad input."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model folder is missing a file, has a malformed one, or holds an unknown architecture."""


class UnsupportedModelError(ModelLoadError):
    """The folder is well-formed but describes something this engine does not implement."""


class ConfigError(EngineError):
    """A bad engine setting (names the setting and the value)."""


class RequestError(EngineError):
    """A bad request (names the field). The server maps it to an OpenAI-style 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConnectorError(EngineError):
    """An unknown ``--kv-connector`` URL scheme or a connector that failed to start."""
