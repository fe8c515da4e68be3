"""docs/reference/grpc.md: every gRPC service, RPC, message and enum of protos/, with their comments.

The .proto files are compiled by protoc (grpcio-tools, as protos/generate.py does for the Python
code) into a descriptor set that keeps the source's comments (--include_source_info); the page is
that descriptor set written out, so it holds what the generated code holds, comments included.
"""

from __future__ import annotations

import pathlib
import tempfile

from google.protobuf import descriptor_pb2

from scripts.docgen.markdown import anchor, cell, code, page, table

F = descriptor_pb2.FieldDescriptorProto
# Location path numbers (google/protobuf/descriptor.proto).
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX = 4, 5, 6, 12
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2
SCALARS = {getattr(F, name): name.removeprefix("TYPE_").lower() for name in F.Type.keys()}


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    import grpc_tools
    from grpc_tools import protoc

    from protos.generate import PROTO_ROOT, proto_files

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "api.pb"
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--descriptor_set_out={out}", "--include_source_info",
                *files]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed on protos/; see its messages above")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


class Comments:
    """A file's comments by location path."""

    def __init__(self, proto: descriptor_pb2.FileDescriptorProto):
        self.by_path = {tuple(loc.path): loc for loc in proto.source_code_info.location}

    def __call__(self, *path: int) -> str:
        loc = self.by_path.get(path)
        if loc is None:
            return ""
        return " ".join(part.strip() for part in (loc.leading_comments, loc.trailing_comments) if part.strip())

    def file_comment(self) -> str:
        loc = self.by_path.get((FILE_SYNTAX,))
        return " ".join(c.strip() for c in (*loc.leading_detached_comments, loc.leading_comments)) if loc else ""


def type_link(name: str) -> str:
    return f"[{code(name)}](#{anchor(name)})"


def field_type(field: F, maps: dict[str, tuple[F, F]]) -> str:
    name = field.type_name.lstrip(".")
    if name in maps:
        key, value = maps[name]
        return f"map&lt;{field_type(key, maps)}, {field_type(value, maps)}&gt;"
    kind = type_link(name) if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM) else code(SCALARS[field.type])
    if field.label == F.LABEL_REPEATED:
        return "repeated " + kind
    return ("optional " if field.proto3_optional else "") + kind


def message_sections(message, prefix: str, path: tuple, comments: Comments, maps: dict) -> list[str]:
    full = f"{prefix}.{message.name}"
    rows = []
    for i, field in enumerate(message.field):
        oneof = ""
        if field.HasField("oneof_index") and not field.proto3_optional:
            oneof = f" (one of `{message.oneof_decl[field.oneof_index].name}`)"
        rows.append([code(field.name), str(field.number), field_type(field, maps),
                     cell(comments(*path, MESSAGE_FIELD, i)) + oneof])
    body = table(["Field", "Number", "Type", "Description"], rows) if rows else "No fields."
    out = [f"### `{full}`\n\n" + (cell(comments(*path)) + "\n\n" if comments(*path) else "") + body]
    for i, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            out += message_sections(nested, full, (*path, MESSAGE_NESTED, i), comments, maps)
    for i, enum in enumerate(message.enum_type):
        out.append(enum_section(enum, full, (*path, MESSAGE_ENUM, i), comments))
    return out


def enum_section(enum, prefix: str, path: tuple, comments: Comments) -> str:
    rows = [[code(v.name), str(v.number), cell(comments(*path, ENUM_VALUE, i))] for i, v in enumerate(enum.value)]
    return (f"### `{prefix}.{enum.name}`\n\nAn enum. " + (cell(comments(*path)) + "\n\n" if comments(*path) else "\n\n")
            + table(["Value", "Number", "Description"], rows))


def service_section(service, package: str, path: tuple, comments: Comments) -> str:
    rows = []
    for i, method in enumerate(service.method):
        request = ("stream " if method.client_streaming else "") + type_link(method.input_type.lstrip("."))
        response = ("stream " if method.server_streaming else "") + type_link(method.output_type.lstrip("."))
        rows.append([code(method.name), request, response, cell(comments(*path, SERVICE_METHOD, i))])
    return (f"### `{package}.{service.name}`\n\nA service. " + (cell(comments(*path)) + "\n\n" if comments(*path) else "\n\n")
            + table(["RPC", "Request", "Response", "What it does; deadline and retry"], rows))


def _maps(proto) -> dict[str, tuple[F, F]]:
    """Full names of the map-entry messages -> (key field, value field)."""
    found = {}

    def walk(message, prefix: str) -> None:
        for nested in message.nested_type:
            name = f"{prefix}.{message.name}.{nested.name}"
            if nested.options.map_entry:
                found[name] = (nested.field[0], nested.field[1])
            walk(nested, f"{prefix}.{message.name}")

    for message in proto.message_type:
        walk(message, proto.package)
    return found


def file_section(proto) -> str:
    comments = Comments(proto)
    maps = _maps(proto)
    parts = [f"## `{proto.name}`\n\nPackage `{proto.package}`. {cell(comments.file_comment())}"]
    parts += [service_section(s, proto.package, (FILE_SERVICE, i), comments) for i, s in enumerate(proto.service)]
    for i, message in enumerate(proto.message_type):
        parts += message_sections(message, proto.package, (FILE_MESSAGE, i), comments, maps)
    parts += [enum_section(e, proto.package, (FILE_ENUM, i), comments) for i, e in enumerate(proto.enum_type)]
    return "\n\n".join(parts)


def render() -> str:
    files = sorted((f for f in descriptor_set().file if f.package.startswith("rlmesh.")), key=lambda f: f.name)
    rows = [[f"[{code(f.name)}](#{anchor(f.name)})", code(f.package),
             ", ".join(code(s.name) for s in f.service) or "types only"] for f in files]
    intro = ("The API between the services, one service per file under `protos/` (package `rlmesh.<service>.v1`). "
             "Every service also serves `grpc.health.v1.Health` and server reflection. Bulk numbers travel as "
             "`rlmesh.common.v1.Tensor` (raw little-endian bytes with dtype and shape). Each RPC's description says "
             "what a client must do: its deadline and whether a retry is safe.\n\n"
             + table(["File (under protos/)", "Package", "Services"], rows))
    return page("gRPC API", intro, [file_section(f) for f in files])
