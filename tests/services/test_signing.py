"""services/signing.py: Ed25519 keys, canonical payloads, sign/verify against a trust list, key files."""

from __future__ import annotations

import stat

import pytest

from services.errors import InvalidArgument, Untrusted
from services.signing import (
    PROGRAM_DOMAIN,
    Signature,
    SigningKey,
    TrustedKeys,
    program_payload,
    signing_key_from,
    trusted_keys_from,
)

PAYLOAD = program_payload("llama.decode.aoti", "ab" * 32, "cd" * 32, 4096, "file", "runner-0@h:1")


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def test_sign_verify_round_trip_through_text_and_files(tmp_path):
    key = SigningKey.generate()
    key_path, pub_path = key.write(tmp_path, "runner-0")
    loaded = SigningKey.load(key_path)
    assert loaded.key_id == key.key_id and len(key.key_id) == 16
    sig = loaded.sign(PAYLOAD)
    trusted = TrustedKeys.load(pub_path)
    assert trusted.verify(PAYLOAD, sig.to_text(), "program") == key.key_id
    assert Signature.from_text(sig.to_text()) == sig
    assert TrustedKeys.load(tmp_path).key_ids == [key.key_id]  # a directory of .pub files


def test_one_flipped_byte_of_payload_or_signature_is_refused():
    key = SigningKey.generate()
    trusted = TrustedKeys([key.public_key()])
    sig = key.sign(PAYLOAD)
    for at in (0, len(PROGRAM_DOMAIN) + 3, len(PAYLOAD) - 1):
        with pytest.raises(Untrusted, match="does not match"):
            trusted.verify(_flip(PAYLOAD, at), sig, "program p")
    for at in (0, 31, 63):
        with pytest.raises(Untrusted, match="does not match"):
            trusted.verify(PAYLOAD, Signature(sig.key_id, _flip(sig.signature, at)), "program p")


def test_a_key_not_in_the_trust_list_and_a_missing_signature_are_refused():
    trusted = TrustedKeys([SigningKey.generate().public_key()])
    other = SigningKey.generate()
    with pytest.raises(Untrusted, match=f"key {other.key_id}, which is not trusted"):
        trusted.verify(PAYLOAD, other.sign(PAYLOAD), "program p")
    with pytest.raises(Untrusted, match="program p is not signed"):
        trusted.verify(PAYLOAD, "", "program p")


@pytest.mark.parametrize("text", ["nocolon", "short:AAAA", "0123456789abcdef:!!!notbase64",
                                  "0123456789abcdef:" + "A" * 20])
def test_malformed_signature_text_is_refused(text):
    trusted = TrustedKeys([SigningKey.generate().public_key()])
    with pytest.raises(Untrusted, match="malformed"):
        trusted.verify(PAYLOAD, text, "program p")


def test_key_file_is_0600_and_never_overwritten(tmp_path):
    key_path, pub_path = SigningKey.generate().write(tmp_path, "k")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    before = key_path.read_bytes()
    with pytest.raises(InvalidArgument, match="never overwritten"):
        SigningKey.generate().write(tmp_path, "k")
    assert key_path.read_bytes() == before


def test_unusable_key_files_and_env_fallback(tmp_path):
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(InvalidArgument, match="not an unencrypted PEM"):
        SigningKey.load(tmp_path / "bad.key")
    with pytest.raises(InvalidArgument, match="no \\*.pub"):
        TrustedKeys.load(tmp_path)
    key_path, pub_path = SigningKey.generate().write(tmp_path / "keys", "w")
    assert signing_key_from(None, env={}) is None and trusted_keys_from(None, env={}) is None
    assert signing_key_from(None, env={"WARMSERVE_SIGNING_KEY": str(key_path)}) is not None
    assert trusted_keys_from(None, env={"WARMSERVE_TRUSTED_KEYS": str(pub_path)}) is not None


def test_keys_new_cli_writes_the_pair_and_refuses_to_overwrite(tmp_path, capsys):
    from warmserve.cli import main

    assert main(["keys", "new", "--out", str(tmp_path / "k"), "--name", "runner-0"]) == 0
    assert stat.S_IMODE((tmp_path / "k" / "runner-0.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    TrustedKeys.load(tmp_path / "k" / "runner-0.pub")
    assert main(["keys", "new", "--out", str(tmp_path / "k"), "--name", "runner-0"]) == 2
    assert "never overwritten" in capsys.readouterr().err
    shared = tmp_path / "shared"  # a directory others may write: they could swap the key under us
    shared.mkdir()
    shared.chmod(0o777)
    assert main(["keys", "new", "--out", str(shared), "--name", "runner-1"]) == 2
    assert f"refusing the key directory {shared}: it is writable by group or others" in capsys.readouterr().err
    assert list(shared.iterdir()) == []


def test_a_remembered_verification_still_refuses_other_bytes():
    """The memo of successful checks is keyed by payload and signature: a flipped byte of either
    is refused after the true pair was verified (twice)."""
    key = SigningKey.generate()
    trusted = TrustedKeys([key.public_key()])
    payload = program_payload("p", "f" * 64, "a" * 64, 4, "file", "me")
    sig = key.sign(payload)
    assert trusted.verify(payload, sig, "p") == key.key_id
    assert trusted.verify(payload, sig, "p") == key.key_id
    with pytest.raises(Untrusted):
        trusted.verify(payload[:-1] + b"X", sig, "p")
    bad = Signature(sig.key_id, bytes([sig.signature[0] ^ 1]) + sig.signature[1:])
    with pytest.raises(Untrusted):
        trusted.verify(payload, bad, "p")
