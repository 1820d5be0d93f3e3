"""generation_config.json in the sidecar: copied from a safetensors checkpoint (and part of its
staleness), refused at pack time when malformed, built from a GGUF's EOS/EOT/EOM and
``general.sampling.*`` metadata."""

from __future__ import annotations

import json
import os

import pytest
from weights_tiny import write_tiny_checkpoint, write_tiny_gguf

from services.errors import InvalidArgument
from weight_service.catalog import sidecar_files
from weight_service.prepare import prepare
from weight_service.sidecar import TEMP_PREFIX

GEN = "generation_config.json"


def test_safetensors_generation_config_is_copied_and_its_changes_make_the_sidecar_stale(tmp_path):
    ckpt, root = tmp_path / "ckpt", tmp_path / "sc"
    write_tiny_checkpoint(ckpt, tokenizer=True)
    first = prepare(str(ckpt), root=root)
    assert first.state == "BUILT" and not (first.path / GEN).exists()

    config = {"eos_token_id": [2, 17], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
              "max_new_tokens": 40, "transformers_version": "4.57.0"}
    (ckpt / GEN).write_text(json.dumps(config))
    added = prepare(str(ckpt), root=root)
    assert added.state == "REBUILT" and added.fingerprint != first.fingerprint
    assert json.loads((added.path / GEN).read_text()) == config  # every key kept
    assert sidecar_files(added.path) == ["config.json", GEN, "tokenizer.json", "tokenizer_config.json",
                                         "model.safetensors"]  # what Fetch streams, weights last
    assert prepare(str(ckpt), root=root).state in ("HOT", "COLD")

    # An edit that keeps the size and the mtime still counts (the file's bytes are hashed).
    st = (ckpt / GEN).stat()
    (ckpt / GEN).write_text(json.dumps({**config, "eos_token_id": [2, 18]}))
    os.utime(ckpt / GEN, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = prepare(str(ckpt), root=root)
    assert edited.state == "REBUILT" and json.loads((edited.path / GEN).read_text())["eos_token_id"] == [2, 18]

    # Deleted from the checkpoint: the repacked sidecar does not keep the old copy.
    (ckpt / GEN).unlink()
    removed = prepare(str(ckpt), root=root)
    assert removed.state == "REBUILT" and not (removed.path / GEN).exists()
    assert removed.fingerprint == first.fingerprint


@pytest.mark.parametrize("text,message", [
    ("{\"eos_token_id\": [2,", "is not valid JSON"),
    ("[2, 17]", "must hold a JSON object, not an array"),
    ("\"eos\"", "must hold a JSON object, not a string"),
    (b"\xff\xfe{}", "is not valid JSON"),
])
def test_a_malformed_generation_config_is_refused_at_pack_time_leaving_no_sidecar(tmp_path, text, message):
    ckpt, root = tmp_path / "ckpt", tmp_path / "sc"
    write_tiny_checkpoint(ckpt, tokenizer=True)
    if isinstance(text, bytes):
        (ckpt / GEN).write_bytes(text)
    else:
        (ckpt / GEN).write_text(text)
    with pytest.raises(InvalidArgument, match=message) as err:
        prepare(str(ckpt), root=root)
    assert str(ckpt / GEN) in str(err.value)
    leftovers = [p for p in root.rglob("*") if p.is_file() and ".locks" not in p.parts]
    assert leftovers == [], leftovers
    assert not any(p.name.startswith(TEMP_PREFIX) for p in root.rglob("*"))


def test_gguf_eos_eot_eom_ids_and_sampling_keys_become_the_generation_config(tmp_path):
    def extra(w):
        w.add_eot_token_id(7)
        w.add_eom_token_id(2)  # the EOS again: listed once
        w.add_sampling_temp(0.6)
        w.add_sampling_top_k(20)
        w.add_sampling_top_p(0.95)

    write_tiny_gguf(tmp_path / "chat.gguf", metadata=extra)
    handle = prepare(str(tmp_path / "chat.gguf"), dtype="f32", root=tmp_path / "sc")
    # 0.6 and 0.95 are stored as float32; the sidecar holds their shortest decimal form.
    assert json.loads((handle.path / GEN).read_text()) == {
        "eos_token_id": [2, 7], "temperature": 0.6, "top_k": 20, "top_p": 0.95}

    write_tiny_gguf(tmp_path / "plain.gguf")
    plain = prepare(str(tmp_path / "plain.gguf"), dtype="f32", root=tmp_path / "sc")
    assert json.loads((plain.path / GEN).read_text()) == {"eos_token_id": [2]}
