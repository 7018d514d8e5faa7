"""Reading a DeepSpeed config: a dict, a JSON or hjson file, or base64-encoded JSON, as
`deepspeed.initialize(config=...)` accepts them.

[Note: config files] DeepSpeed reads config files with hjson (a superset of JSON: comments,
unquoted keys, trailing commas) and rejects duplicate keys. zerokern reads strict JSON with the
standard library first (the common case, no dependency) and falls back to hjson when the file
is not JSON: if hjson is installed (DeepSpeed depends on it) the file means what it means to
DeepSpeed; if not, the error names the file, the JSON error and `pip install hjson`, never a
bare JSONDecodeError. A string that is not an existing path is tried as base64 (what the
HF/Accelerate launchers pass), as DeepSpeed does; otherwise the error says no such file.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, Dict, List, Tuple

from .config_values import ConfigError


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"config has the key {k!r} twice (DeepSpeed rejects duplicates)")
        out[k] = v
    return out


def _parse(text: str, where: str) -> Dict[str, Any]:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        json_error = e
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"config {where} is not valid JSON ({json_error}); DeepSpeed also "
                         "reads hjson (comments, unquoted keys, trailing commas): pip install "
                         "hjson to read it") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"config {where} is neither JSON ({json_error}) nor hjson ({e})") \
            from None


def load_config(config: Any) -> Dict[str, Any]:
    """A dict as given, or the dict in a JSON/hjson file, or in a base64-encoded string.

    Raises:
        ValueError: the file cannot be parsed (naming it), has duplicate keys, does not exist
            (and the string is not base64 JSON), or does not hold a dict.
    """
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if isinstance(config, str):
        if os.path.isfile(config):
            with open(config) as f:
                config = _parse(f.read(), repr(config))
        else:
            try:
                text = base64.urlsafe_b64decode(config).decode("utf-8")
                config = _parse(text, "(base64)")
            except (binascii.Error, UnicodeDecodeError, ValueError):
                raise ConfigError(f"config {config!r}: no such file, and not base64-encoded "
                                 "JSON") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a dict, a path to a JSON/hjson file or base64 JSON, "
                         f"got {type(config).__name__}")
    return config
