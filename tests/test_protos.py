"""The committed generated code is exactly what `scripts/gen_protos` produces now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["protos/decode/v1/decode.proto", "protos/text/v1/text.proto"]


def test_committed_stubs_match_a_fresh_regeneration(tmp_path):
    for proto in PROTOS:
        (tmp_path / proto).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / proto, tmp_path / proto)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", *PROTOS],
        cwd=tmp_path,
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.suffix in (".py", ".pyi"))
    assert len(generated) == 6
    for rel in generated:
        assert (ROOT / rel).read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run scripts/gen_protos"


def test_enums_zero_value_is_unspecified():
    from protos.decode.v1 import decode_pb2

    assert decode_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
