"""The names a server answers to for its model, as vLLM chooses them.

``--served-model-name`` gives them (several are aliases of one model); without it the
model is served under the ``--model`` argument as the user typed it and, when different,
its last path component without ``.gguf`` (``models/foo.Q4_K_M.gguf`` is also
``foo.Q4_K_M``). The default model is ``SmolLM2-135M-Instruct``, plus the name inside
its GGUF (``general.name``), which earlier versions served. The first name is the
primary one: the name in metrics labels, on the dashboard, and for requests that name
no model.
"""

from __future__ import annotations

from pathlib import PurePath

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
MAX_NAME_CHARS = 256


class ServedNameError(ValueError):
    """A ``--served-model-name`` is empty or too long."""


def served_names(requested: list[str] | None, model_arg: str | None, engine_name: str) -> list[str]:
    """The served names, primary first, without duplicates."""
    if requested:
        bad = [n for n in requested if not n.strip() or len(n) > MAX_NAME_CHARS]
        if bad:
            raise ServedNameError(
                f"--served-model-name must be 1 to {MAX_NAME_CHARS} characters, not blank: "
                f"{bad[0][:40]!r}"
            )
        return list(dict.fromkeys(requested))
    if model_arg is None:
        names = [DEFAULT_SERVED_NAME, engine_name]
    else:
        stem = PurePath(model_arg).name
        stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
        names = [model_arg, stem]
    return list(dict.fromkeys(n for n in names if n))
