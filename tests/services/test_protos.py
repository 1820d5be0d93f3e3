"""The committed stubs under services/proto/ are exactly what `make proto` generates."""

from pathlib import Path

from services import protogen


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    assert len(fresh) == 3 * len(protogen.proto_files())
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = protogen.STUB_ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run `make proto`"
        assert committed.read_text() == path.read_text(), f"{rel} is stale; run `make proto`"


def test_all_four_services_are_defined() -> None:
    from services.proto import generation_pb2, kernel_cache_pb2, router_pb2, weights_pb2

    names = {
        s.full_name
        for m in (generation_pb2, kernel_cache_pb2, router_pb2, weights_pb2)
        for s in m.DESCRIPTOR.services_by_name.values()
    }
    assert names == {
        "warmserve.v1.KernelCache",
        "warmserve.v1.Weights",
        "warmserve.v1.Generation",
        "warmserve.v1.RouterControl",
    }
