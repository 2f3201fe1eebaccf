from __future__ import annotations

from pdserve import protogen


def test_generated_code_is_fresh():
    stale = protogen.stale_files()
    assert not stale, f"regenerate with `python -m pdserve.protogen`: {stale}"


def _undocumented(proto_text: str) -> list[str]:
    """``line: text`` of every message field and enum value with no comment on or above it.

    A ``//`` line directly above counts, and so does a trailing ``//`` on the line itself.
    Nested messages and enums and one-line ``message X {}`` blocks are handled."""
    import re

    decl = re.compile(r"^(message|enum|service|oneof)\s+\w+\s*\{(?P<close>\s*\})?")
    field = re.compile(
        r"^(optional\s+|repeated\s+)?(map\s*<[\w.\s,]+>|[\w.]+)\s+\w+\s*=\s*\d+\s*[;\[]"
    )
    enum_value = re.compile(r"^\w+\s*=\s*-?\d+\s*[;\[]")
    missing = []
    stack: list[str] = []
    lines = proto_text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        m = decl.match(stripped)
        if m:
            if not m.group("close"):
                stack.append(m.group(1))
            continue
        if stripped.startswith("}"):
            stack.pop()
            continue
        kind = stack[-1] if stack else ""
        is_item = (kind in ("message", "oneof") and field.match(stripped)) or (
            kind == "enum" and enum_value.match(stripped) and not stripped.endswith("= 0;")
        )
        if not is_item:
            continue
        if "//" in stripped or lines[i - 1].strip().startswith("//"):
            continue
        missing.append(f"{i + 1}: {stripped}")
    assert not stack, f"unbalanced braces: {stack}"
    return missing


def test_every_field_is_commented():
    """Every message field (and every enum value but the zero one) of the contracts carries
    a comment with its meaning and unit: the protos are the contract."""
    missing = []
    for proto in sorted(protogen.PROTO_DIR.glob("*.proto")):
        missing += [f"{proto.name}:{m}" for m in _undocumented(proto.read_text())]
    assert not missing, "fields without a comment:\n" + "\n".join(missing)


def test_the_comment_check_sees_every_kind_of_field():
    text = """message A {}
message B {
  // documented
  string a = 1;
  string b = 2;
  map<string, string> c = 3;
  optional uint64 d = 4;  // trailing comment
  repeated C e = 5;
  message Inner {
    bytes f = 1;
  }
  enum E {
    E_UNSPECIFIED = 0;
    E_ONE = 1;
  }
}
"""
    assert [m.split(": ")[1] for m in _undocumented(text)] == [
        "string b = 2;",
        "map<string, string> c = 3;",
        "repeated C e = 5;",
        "bytes f = 1;",
        "E_ONE = 1;",
    ]
