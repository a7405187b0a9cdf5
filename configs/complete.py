"""Write every config in configs/ out in full: params.yaml's keys, order and comments, the config's values.

DVC tracks, and ``dvc exp run -S`` can set, only keys present in params.yaml, so a config copied
over it must hold every key ("Key 'kl_coef' is not in struct" otherwise). Run after adding a param:

    python configs/complete.py            # rewrites configs/*.yaml in place; values never change

A config's own header comment and end-of-line comments are kept.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
NOTE = ("# Every key of params.yaml is here (so `dvc exp run -S` can set any of them after\n"
        "# `cp {path} params.yaml`); the values that differ from params.yaml are this config's.\n")


def _header(text: str) -> str:
    lines = []
    for line in text.splitlines(True):
        if not line.startswith("#"):
            break
        lines.append(line)
    return "".join(line for line in lines if "Every key of params.yaml" not in line and "`cp configs/" not in line)


def _split(cmap, key) -> tuple[str, str]:
    """(end-of-line comment of `key`, comment lines before the key after it) as ruamel stores them."""
    token = cmap.ca.items.get(key, [None, None, None])[2]
    if token is None:
        return "", ""
    eol, _, after = token.value.partition("\n")
    return eol, after


def _set(cmap, key, eol: str, after: str) -> None:
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    eol = " " + eol.lstrip() if eol.strip() else ""  # two spaces before the `#`, as written by hand
    value = eol + "\n" + after if (eol or after) else ""
    if not value:
        cmap.ca.items.pop(key, None)
        return
    items = cmap.ca.items.setdefault(key, [None, None, None, None])
    items[2] = CommentToken(value, CommentMark(0), None)


def _merge_section(full, values) -> None:
    """Put the config's values (and its comments on them) into params.yaml's section."""
    keys, order = list(values), list(full)
    for i, key in enumerate(keys):
        if key not in full:
            raise SystemExit(f"{key} is not in params.yaml")
        full[key] = values[key]
        eol, _ = _split(values, key)
        pre = _split(values, keys[i - 1])[1] if i else ""
        if eol:
            _set(full, key, eol, _split(full, key)[1])
        j = order.index(key)
        if pre and j:
            _set(full, order[j - 1], _split(full, order[j - 1])[0], pre)


def complete(path: Path, yaml: YAML) -> str:
    text = path.read_text()
    config = yaml.load(text) or {}
    full = yaml.load((ROOT / "params.yaml").read_text())
    for section, values in config.items():
        if section not in full:
            raise SystemExit(f"{path}: section {section!r} is not in params.yaml")
        _merge_section(full[section], values)
    buf = io.StringIO()
    yaml.dump(full, buf)
    body = buf.getvalue().splitlines(True)
    start = next(i for i, line in enumerate(body) if line.strip() and not line.startswith("#"))
    rel = path.relative_to(ROOT)
    return _header(text) + NOTE.format(path=rel) + "\n" + "".join(body[start:])


def main() -> int:
    yaml = YAML()
    yaml.width = 200
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        path.write_text(complete(path, yaml))
    return 0


if __name__ == "__main__":
    sys.exit(main())
