"""The README's curl example names a model that ``pagewarden serve`` serves by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_curl_names_the_default_model():
    from pagewarden.models.gguf_metadata import read_gguf_metadata
    from pagewarden.models.loader import default_model_path

    path = default_model_path()
    fields = read_gguf_metadata(path)
    from pagewarden.server.model_names import served_names

    # The name the loader gives the default model (models/loader.py, _load_gguf).
    internal = str(fields["general.name"]) if "general.name" in fields else path.stem
    served = served_names(None, None, internal)  # what `pagewarden serve` answers to
    bodies = re.findall(
        r"curl localhost:8000/v1/completions .*?-d '(\{.*?\})'", README.read_text(), re.S
    )
    assert bodies, "no curl example in the README"
    assert json.loads(bodies[0])["model"] in served
