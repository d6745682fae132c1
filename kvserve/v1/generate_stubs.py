"""Regenerate the committed gRPC stubs (`kvserve/v1/generator_pb2*.py[i]`) from the proto.

`make protos` runs ``python -m kvserve.v1.generate_stubs``; the stale-stub test calls
`generate(tmp_dir)` and compares with the committed files. Knows nothing about serving.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTOS = ("kvserve/v1/generator.proto",)
OUTPUTS = ("generator_pb2.py", "generator_pb2.pyi", "generator_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root` (modules land in `out_root/kvserve/v1/`); return their paths.

    Raises RuntimeError with protoc's exit status when generation fails.
    """
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / "kvserve" / "v1").mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            proto,
        ]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto} with status {status}")
    return [out_root / "kvserve" / "v1" / name for name in OUTPUTS]


def main() -> int:
    """Regenerate the stubs in place and print what was written."""
    for path in generate(REPO_ROOT):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
