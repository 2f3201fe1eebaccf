from __future__ import annotations

from pdserve import protogen


def test_generated_code_is_fresh():
    stale = protogen.stale_files()
    assert not stale, f"regenerate with `python -m pdserve.protogen`: {stale}"


def test_every_field_is_commented_or_self_describing():
    """Every message field of the contracts carries a comment on or above it, except plain
    identifiers whose meaning is their name (ids, keys, codes, nested messages)."""
    import re

    self_describing = re.compile(
        r"^\s*(repeated\s+)?(string|bytes|bool|\w+\.?\w*)\s+(\w*_id|key|keys|code|message|"
        r"type|role|transport|address|instance|segment|replicas|results|options|sampling|kv|"
        r"items|models|events|held|endpoints|segments|instances|load|name|text|token_ids|"
        r"tokens|exists|finish_reason|mode|messages|content|placement|request_id|model|"
        r"fingerprint|reason|length)\s*=\s*\d+;"
    )
    missing = []
    for proto in sorted(protogen.PROTO_DIR.glob("*.proto")):
        lines = proto.read_text().splitlines()
        depth = 0
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith(("message ", "enum ", "service ")):
                depth += 1
                kind = stripped.split()[0]
                continue
            if stripped == "}":
                depth -= 1
                continue
            is_field = re.match(r"^(optional\s+|repeated\s+)?[\w.<>, ]+\s+\w+\s*=\s*\d+;", stripped)
            if depth and kind == "message" and is_field:
                prev = lines[i - 1].strip()
                if "//" in line or prev.startswith("//") or self_describing.match(line):
                    continue
                missing.append(f"{proto.name}:{i + 1}: {stripped}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)
