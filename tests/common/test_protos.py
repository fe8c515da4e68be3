"""The committed generated code must match the .proto files."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_current():
    result = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_proto_follows_the_house_rules():
    for proto in sorted((ROOT / "protos").glob("rlmesh/**/*.proto")):
        text = proto.read_text()
        rel = proto.relative_to(ROOT / "protos").parent
        assert f"package {'.'.join(rel.parts)};" in text, f"{proto}: package must mirror the path"
        assert text.count("\nservice ") <= 1, f"{proto}: one service per file"
        lines = text.splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_decl = (stripped.startswith("rpc ") or
                       (stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "//"))))
            if is_decl:
                prev = lines[i - 1].strip()
                assert prev.startswith("//"), f"{proto}:{i + 1}: needs a comment: {stripped}"
            if stripped.startswith("enum "):
                first_value = next(lines[j].strip() for j in range(i + 1, len(lines))
                                   if lines[j].strip() and not lines[j].strip().startswith("//"))
                assert "_UNSPECIFIED = 0;" in first_value, f"{proto}:{i + 1}: enum value 0 must be *_UNSPECIFIED"
