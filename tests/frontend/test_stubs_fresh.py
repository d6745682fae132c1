"""The committed gRPC stubs must match what `make protos` generates from the proto."""

from __future__ import annotations

import re
from pathlib import Path

from kvserve.v1 import generate_stubs

# Lines that only record which protoc/grpcio-tools produced the file.
_VERSION_LINE = re.compile(r"(Protobuf Python Version|GRPC_GENERATED_VERSION|_runtime_version\.ValidateProtobufRuntimeVersion|^\s*\d+,\s*$|^\s*'',\s*$)")


def _normalized(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not _VERSION_LINE.search(line)]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = generate_stubs.generate(tmp_path)
    committed_dir = generate_stubs.REPO_ROOT / "kvserve" / "v1"
    assert [p.name for p in fresh] == list(generate_stubs.OUTPUTS)
    for path in fresh:
        committed = committed_dir / path.name
        assert committed.exists(), f"{committed} missing: run `make protos`"
        assert _normalized(path) == _normalized(committed), (
            f"{committed.name} is stale: run `make protos` and commit the result"
        )


def test_stubs_import_and_describe_the_service() -> None:
    from kvserve.v1 import generator_pb2, generator_pb2_grpc

    service = generator_pb2.DESCRIPTOR.services_by_name["Generator"]
    assert [m.name for m in service.methods] == [
        "Generate", "GetModelInfo", "Tokenize", "Abort", "GetLoad",
    ]
    assert service.methods_by_name["Generate"].server_streaming
    assert hasattr(generator_pb2_grpc, "GeneratorServicer")
