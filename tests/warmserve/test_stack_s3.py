"""Two hosts that share nothing but an S3 bucket (issue 14 part 3): two ``warmserve up``-style
stacks (LocalStack, different homes, free ports, ``--store`` on the same bucket of a real S3
server, moto, on loopback). The first packs the sidecar and compiles its programs (AOTInductor)
cold; the second one's first runner starts warm: programs from the kernel cache (HIT, fetched
from the bucket), the sidecar fetched, zero compiles and zero packs, and it answers exactly as
the first did. A tiny random Llama keeps the cold compile to about 40 s on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from weights_tiny import write_tiny_checkpoint, write_word_tokenizer

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.s3_entries import ENTRIES, PARTS
from services.errors import InvalidArgument
from services.generation_client import GenerationClient
from services.ports import KERNEL_CACHE, ROUTER, WEIGHTS
from services.proto import generation_pb2 as pb
from warmserve.cli import build_parser
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig

VOCAB = 96
PROGRAMS = ("llama.decode.aoti", "llama.prefill.aoti")


def _config(home: Path, model: Path, store: str) -> StackConfig:
    return StackConfig(runners=1, base_port=0, home=home, model=str(model), compile="aoti", dtype="f32",
                       max_num_seqs=4, store=store, record_state=False, startup_timeout_s=600, stop_grace_s=10,
                       runner_args=("--max-model-len", "64", "--kv-cache-bytes", "2000000"))


def _greedy(stack: LocalStack) -> list[int]:
    req = pb.GenerateRequest(text="w5 w6 w7 w8", sampling=pb.SamplingParams(max_tokens=8, temperature=0,
                                                                            ignore_eos=True))
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:
        return list(client.complete(req, timeout_s=120).token_ids)


def _log_messages(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line).get("msg", ""))
        except ValueError:
            continue
    return out


def _phase(info, name: str) -> str:
    return next(p.detail for p in info.startup.phases if p.name == name)


def test_up_store_reaches_both_daemons_and_a_bad_one_stops_the_launch(tmp_path, s3):
    config = StackConfig.from_args(build_parser().parse_args(["up", "--store", s3.url, "--base-port", "50100"]))
    assert config.store == s3.url
    stack = LocalStack(StackConfig(runners=1, base_port=0, home=tmp_path, store=config.store), progress=None)
    for name, command in ((KERNEL_CACHE, ["cache", "serve"]), (WEIGHTS, ["weights", "serve"])):
        argv = stack.commands.service(name)
        assert argv[3:5] == command and argv[argv.index("--store") + 1] == s3.url
    assert "--store" not in stack.commands.service(ROUTER) and "--store" not in stack.runner_argv(0)
    stack.preflight()  # the bucket answers and honours conditional writes
    with pytest.raises(InvalidArgument, match="not a valid S3 bucket name"):
        StackConfig(store="s3://Not_A_Bucket/team")
    missing = LocalStack(StackConfig(runners=1, base_port=0, home=tmp_path, store="s3://warmserve-missing-bucket/t"),
                         progress=None)
    with pytest.raises(InvalidArgument, match="does not exist"):
        missing.start()  # refused before any child is launched
    assert missing.services == {} and not (tmp_path / "logs").exists()
    assert s3.keys() == []


@pytest.mark.slow
def test_a_second_host_starts_warm_from_the_bucket_alone(tmp_path, s3):
    model = tmp_path / "model"  # the same path on both hosts: one image, one checkpoint
    write_tiny_checkpoint(model, vocab=VOCAB)
    write_word_tokenizer(model, VOCAB - 1)

    # Host A: cold. Packs the sidecar, serves eager, compiles both programs and publishes them.
    with LocalStack(_config(tmp_path / "home-a", model, s3.url), progress=None) as host_a:
        info_a = host_a.wait_programs(0)
        assert info_a.program_state == "installed", info_a.program_detail
        assert "BUILT" in _phase(host_a.startup_report(0), "sidecar")
        with KernelCacheClient(host_a.address(KERNEL_CACHE), security=host_a.credentials("admin")) as cache_a:
            stat_a = cache_a.stat()
            assert sorted(e.name for e in cache_a.list()) == sorted(PROGRAMS)
        assert (stat_a["builds"], stat_a["publishes"]) == (2, 2)
        tokens_a = _greedy(host_a)
    assert len(tokens_a) == 8
    keys = s3.keys()
    assert sorted(k.split("/")[3] for k in keys if k.startswith(f"team/kernel-cache/{ENTRIES}/")) == sorted(PROGRAMS)
    assert sorted(k.split("/")[3] for k in keys if k.startswith(f"team/kernel-cache/{PARTS}/")) == sorted(PROGRAMS)
    assert len([k for k in keys if k.startswith("team/sidecars/") and k.endswith("/manifest.json")]) == 1

    # Host B: another home (no shared disk), the same bucket. Warm from its first runner on.
    home_b = tmp_path / "home-b"
    with LocalStack(_config(home_b, model, s3.url), progress=None) as host_b:
        info_b = host_b.startup_report(0)
        programs = _phase(info_b, "programs")
        assert info_b.program_state == "installed", info_b.program_detail
        assert programs.count("kernel cache HIT") == 2 and "compiled" not in programs, programs
        sidecar = _phase(info_b, "sidecar")
        assert "BUILT" not in sidecar and sidecar.startswith("sidecar HOT"), sidecar
        with KernelCacheClient(host_b.address(KERNEL_CACHE), security=host_b.credentials("admin")) as cache_b:
            stat_b = cache_b.stat()
        assert (stat_b["builds"], stat_b["publishes"], stat_b["misses"], stat_b["waits"]) == (0, 0, 0, 0)
        assert stat_b["hits"] >= 2 and stat_b["entries"] == 2  # both programs now on host B's disk
        assert _greedy(host_b) == tokens_a  # the same answer, from the programs host A compiled
    weights_log = _log_messages(home_b / "logs" / "weights.log")
    assert "fetched sidecar from the object store" in weights_log
    assert "packed sidecar" not in weights_log
    assert sorted((home_b / "kernel-cache" / "entries").iterdir()) != []
    assert s3.keys() == keys  # host B added nothing to the bucket
