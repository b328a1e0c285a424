"""The generated stubs in wire/ are what the contract in proto/ generates today."""

import subprocess
import sys

from atoll.wire import codegen


def test_stubs_are_fresh():
    generated = codegen.generate()
    assert set(generated) == {"syncer_pb2.py", "syncer_pb2.pyi", "syncer_pb2_grpc.py"}
    for name, text in generated.items():
        committed = (codegen.OUT_DIR / name).read_text()
        assert committed == text, f"wire/{name} is stale: run `python -m atoll.wire.codegen`"


def test_check_flag_reports_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(codegen, "OUT_DIR", tmp_path)
    (tmp_path / "syncer_pb2.py").write_text("# edited by hand\n")
    assert codegen.main(["--check"]) == 1


def test_stubs_import_and_name_the_service():
    from atoll.wire import syncer_pb2, syncer_pb2_grpc

    service = syncer_pb2.DESCRIPTOR.services_by_name["Syncer"]
    assert service.full_name == "atoll.v1.Syncer"
    assert {m.name for m in service.methods} == {
        "Init",
        "Push",
        "PushStream",
        "Pull",
        "Watch",
        "Describe",
        "Freeze",
        "Unfreeze",
        "Export",
        "Adopt",
        "Commit",
    }
    adopt, export = service.methods_by_name["Adopt"], service.methods_by_name["Export"]
    assert adopt.client_streaming and export.server_streaming
    push = service.methods_by_name["Push"]
    assert push.client_streaming and not push.server_streaming
    stream = service.methods_by_name["PushStream"]
    assert stream.client_streaming and stream.server_streaming
    pull = service.methods_by_name["Pull"]
    assert pull.server_streaming and not pull.client_streaming
    assert hasattr(syncer_pb2_grpc, "add_SyncerServicer_to_server")


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "bench" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "bench", "codec", "--params", "x"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "whole number" in bad.stderr and "Traceback" not in bad.stderr
