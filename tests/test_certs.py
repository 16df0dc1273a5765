"""Member certificates (dpwa.wire.certs): signed by a cluster key, checked field by field, and the keygen commands.

The cluster key is RFC 8032's first Ed25519 test key and the members' CURVE
keys are libzmq's test keys, so every field of a certificate, and so its
bytes, are known in advance: issued at 1.7e9 s, valid 30 days.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import zmq.auth
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from zmq.utils import z85

from conftest import ROOT
from dpwa import cli
from dpwa.gossip.membership import view as membership
from dpwa.wire import certs
from dpwa.wire.curve import KeyFileError

# RFC 8032, section 7.1, TEST 1
CLUSTER = Ed25519PrivateKey.from_private_bytes(
    bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
)
CLUSTER_PUBLIC_BYTES = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))  # another cluster's key
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # libzmq's test server public key (Z85)
OTHER_KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"  # libzmq's test client public key
NOW = 1_700_000_000
VALID_S = 30 * 86400
NOT_AFTER = NOW + VALID_S
CLUSTER_ID = hashlib.sha256(CLUSTER_PUBLIC_BYTES).digest()[:8]
# The format, pinned: a certificate issued by an older dpwa must still read the same (Ed25519 is deterministic).
W1_CERT = (
    "ASH-Md-hVKJhAAAAAGVT8QAAAAAAZXt-AFT8uiTpMkmWkxb7YXyHK7DB0f8UgAQnxZTL-s8bwtZSAncxfqlj62SQKEwjqMRk0yzlQRv4kxVs2F2I"
    "j3UNPJYBy_h8av1SBGs4fYVSbJzbf2bP7GG3YLsRd5K5NTYZi4PXBg"
)


def cert_for(name: str = "w1", key: str = KEY, secret: Ed25519PrivateKey = CLUSTER) -> str:
    return certs.sign(secret, name, key, VALID_S, now=NOW)


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def raw_of(cert: str) -> bytes:
    return base64.urlsafe_b64decode(cert + "=" * (-len(cert) % 4))


def verdict(cert: object, name: object = "w1", key: object = KEY, now: float = NOW + 60) -> str:
    return certs.verify(CLUSTER.public_key(), cert, name, key, now)


# --------------------------------------------------------------------------- the format


def test_a_certificate_holds_the_documented_layout_and_signature():
    cert = cert_for()
    assert cert == W1_CERT and len(cert) == 166  # 124 bytes: 58 of fields, a 2-byte name, 64 of signature
    raw = raw_of(cert)
    assert len(raw) == 124
    body, signature = raw[:-64], raw[-64:]
    assert struct.unpack(">B8sQQ32sB", body[:58]) == (1, CLUSTER_ID, NOW, NOT_AFTER, z85.decode(KEY), 2)
    assert body[58:] == b"w1"
    # the signature checks with the raw public key, over the context string and the body
    Ed25519PublicKey.from_public_bytes(CLUSTER_PUBLIC_BYTES).verify(signature, b"dpwa member certificate\0" + body)
    fields = certs.decode(cert)
    assert (fields.cluster_id, fields.name, fields.curve_public) == (CLUSTER_ID, "w1", KEY)
    assert (fields.issued_at, fields.not_after, fields.version, fields.signature) == (NOW, NOT_AFTER, 1, signature)
    assert certs.key_id(CLUSTER.public_key()) == CLUSTER_ID


def test_the_longest_name_fits_cert_max():
    cert = cert_for("n" * 64)
    assert len(cert) == 248 <= certs.CERT_MAX
    assert verdict(cert, name="n" * 64) == "ok"


def test_the_rules_for_names_and_keys_are_membership_s():
    assert certs.NAME_RE.pattern == membership._NAME_RE.pattern
    assert certs.KEY_RE.pattern == membership._KEY_RE.pattern


def test_sign_refuses_bad_arguments_naming_them():
    for name in ("a/b", "w1\n", "", "n" * 65):
        with pytest.raises(ValueError, match="name must be 1 to 64"):
            certs.sign(CLUSTER, name, KEY, VALID_S, now=NOW)
    with pytest.raises(ValueError, match="curve_public must be a 40-character Z85"):
        certs.sign(CLUSTER, "w1", KEY[:39], VALID_S, now=NOW)
    with pytest.raises(ValueError, match="curve_public must be a 40-character Z85"):
        certs.sign(CLUSTER, "w1", KEY + "\n", VALID_S, now=NOW)
    for valid_s in (0, -1, certs.MAX_VALID_S + 1, 1.5, True):
        with pytest.raises(ValueError, match="valid_s must be a whole number of seconds"):
            certs.sign(CLUSTER, "w1", KEY, valid_s, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="now must be unix seconds"):
        certs.sign(CLUSTER, "w1", KEY, VALID_S, now=-1)


# --------------------------------------------------------------------------- verify: every verdict


def test_a_valid_certificate_is_ok_from_skew_before_issue_to_expiry():
    assert verdict(W1_CERT) == "ok"
    assert verdict(W1_CERT, now=NOW - certs.CLOCK_SKEW_S) == "ok"  # the verifier's clock 300 s behind
    assert verdict(W1_CERT, now=NOT_AFTER) == "ok"


def test_time_refusals():
    assert verdict(W1_CERT, now=NOW - certs.CLOCK_SKEW_S - 1) == "not_yet_valid"
    assert verdict(W1_CERT, now=NOT_AFTER + 1) == "expired"


def test_a_certificate_replayed_for_another_name_or_key_is_refused():
    assert verdict(W1_CERT, name="w2") == "name_mismatch"
    assert verdict(W1_CERT, key=OTHER_KEY) == "key_mismatch"
    assert verdict(W1_CERT, key=None) == "key_mismatch"
    assert verdict(W1_CERT, name=7, key=b"x") == "name_mismatch"  # whatever a peer sends: a verdict


def test_another_cluster_s_certificate_is_wrong_cluster():
    assert verdict(cert_for(secret=OTHER)) == "wrong_cluster"


def test_forged_or_altered_certificates_fail_the_signature():
    fields = certs.decode(W1_CERT)
    forged = replace(fields, signature=OTHER.sign(fields.signed_bytes()))  # claims our key id, signed by another
    assert verdict(forged.encode()) == "bad_signature"
    longer = replace(fields, not_after=NOT_AFTER + 86400)  # a longer life, the old signature
    assert verdict(longer.encode()) == "bad_signature"
    renamed = replace(fields, name="w2")
    assert verdict(renamed.encode(), name="w2") == "bad_signature"
    raw = bytearray(raw_of(W1_CERT))
    for index in (123, 58 + 2, 30, 20):  # a bit of the signature (last, first byte), of the key, of not_after
        flipped = bytearray(raw)
        flipped[index] ^= 0x01
        assert verdict(b64(bytes(flipped))) == "bad_signature", index


def test_malformed_certificates_are_bad_cert():
    raw = raw_of(W1_CERT)
    version_2 = b"\x02" + raw[1:]
    long_name = raw[:57] + b"\x03" + raw[58:]  # says 3 bytes of name, holds 2
    bad_name = replace(certs.decode(W1_CERT), name="w/1")
    newline = replace(certs.decode(W1_CERT), name="w1\n")  # a regex's '$' alone would let it through
    times = replace(certs.decode(W1_CERT), issued_at=NOT_AFTER + 1)
    cases = {
        "a number": 42,
        "bytes": W1_CERT.encode(),
        "empty": "",
        "oversized": "A" * (certs.CERT_MAX + 1),
        "garbage": "not base64!",
        "padded": W1_CERT + "==",
        "impossible length": W1_CERT[:-1] + "AAAAA",  # length 1 mod 4
        "non-canonical": W1_CERT[:-1] + "h",  # 'g' and 'h' decode alike: only one spelling is accepted
        "too short": b64(raw[:100]),
        "one byte more": b64(raw + b"\0"),
        "one byte less": b64(raw[:-1]),
        "version 2": b64(version_2),
        "name length": b64(long_name),
        "bad name": b64(bad_name.body() + CLUSTER.sign(bad_name.signed_bytes())),
        "a name with a newline": b64(newline.body() + CLUSTER.sign(newline.signed_bytes())),
        "issued after expiry": b64(times.body() + CLUSTER.sign(times.signed_bytes())),
    }
    for what, cert in cases.items():
        assert verdict(cert) == "bad_cert", what
    assert verdict(None) == "no_cert"
    assert raw_of(W1_CERT[:-1] + "h") == raw and W1_CERT.endswith("g")
    with pytest.raises(ValueError, match="not canonical"):
        certs.decode(W1_CERT[:-1] + "h")
    with pytest.raises(ValueError, match="this dpwa reads version 1"):
        certs.decode(b64(version_2))


def test_no_mutation_of_a_certificate_raises_or_passes():
    import random

    rng = random.Random(7)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=+/ \x00é"
    for _ in range(2000):
        chars = list(W1_CERT)
        for _ in range(rng.randint(1, 4)):
            action, at = rng.randrange(3), rng.randrange(len(chars))
            if action == 0:
                chars[at] = rng.choice(alphabet)
            elif action == 1:
                chars.insert(at, rng.choice(alphabet))
            else:
                del chars[at]
        mutated = "".join(chars)
        if mutated != W1_CERT:
            assert verdict(mutated) in certs.REFUSALS, mutated


# --------------------------------------------------------------------------- the view's consent


def test_the_certifier_decides_for_a_view_and_counts_refusals_by_reason():
    held = {"w1": W1_CERT, "w2": cert_for("w2", OTHER_KEY), "w3": cert_for("w3", secret=OTHER)}
    clock = [NOW + 60.0]
    certifier = certs.Certifier(CLUSTER.public_key(), clock=lambda: clock[0])
    own = membership.MemberInfo("w0", "tcp://10.0.0.1:5000", KEY)
    view = membership.View(own, keyed=True, trusted=certifier)

    def entry(name: str, host: int, **cert: object) -> dict[str, object]:
        return {"name": name, "endpoint": f"tcp://10.0.0.{host}:5000", "key": KEY, **cert, "inc": 1, "beat": 1}

    digest = [
        entry("w1", 2, cert=held["w1"]),
        entry("w2", 3, cert=held["w2"]),  # not its key
        entry("w3", 4, cert=held["w3"]),  # another cluster
        entry("w4", 5),  # no certificate
    ]
    added = view.merge("w1", digest, now=0.0)
    assert [m.name for m in added] == ["w1"]
    assert view.refused["untrusted_key"] == 3
    assert certifier.refused == {"key_mismatch": 1, "wrong_cluster": 1, "no_cert": 1}
    clock[0] = NOT_AFTER + 1
    assert certifier("w1", KEY, W1_CERT) is False
    assert certifier.stats() == {
        "certs_refused.expired": 1,
        "certs_refused.key_mismatch": 1,
        "certs_refused.no_cert": 1,
        "certs_refused.wrong_cluster": 1,
    }


# --------------------------------------------------------------------------- key files


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_cluster_key_files_have_exact_modes_whatever_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        public, secret = certs.generate_cluster_key(tmp_path / "admin")
    finally:
        os.umask(previous)
    assert (public, secret) == (tmp_path / "admin" / "cluster.pub", tmp_path / "admin" / "cluster.secret")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(public).st_mode) == 0o644
    assert sorted(os.listdir(tmp_path / "admin")) == ["cluster.pub", "cluster.secret"]  # no temporary file left
    line = public.read_text()
    assert line.startswith("dpwa-cluster-public ") and line.count("\n") == 1 and len(line) == 20 + 44 + 1
    loaded_secret, loaded_public = certs.load_cluster_secret(secret), certs.load_cluster_public(public)
    assert loaded_secret.public_key().public_bytes_raw() == loaded_public.public_bytes_raw()
    cert = certs.sign(loaded_secret, "w1", KEY, VALID_S, now=NOW)
    assert certs.verify(loaded_public, cert, "w1", KEY, NOW) == "ok"


def test_cluster_keys_are_never_overwritten(tmp_path):
    public, secret = certs.generate_cluster_key(tmp_path)
    before = (public.read_bytes(), secret.read_bytes())
    with pytest.raises(FileExistsError, match=r"cluster\.pub exists; remove it first"):
        certs.generate_cluster_key(tmp_path)
    public.unlink()
    with pytest.raises(FileExistsError, match=r"cluster\.secret exists"):
        certs.generate_cluster_key(tmp_path)
    assert secret.read_bytes() == before[1] and not public.exists()
    other_public, _ = certs.generate_cluster_key(tmp_path, name="other")
    assert other_public.name == "other.pub" and other_public.read_bytes() != before[0]


def test_unsafe_or_wrong_cluster_key_files_are_refused_naming_them(tmp_path):
    public, secret = certs.generate_cluster_key(tmp_path)
    os.chmod(secret, 0o640)
    with pytest.raises(
        KeyFileError, match=r"cluster\.secret: .* can be read by others \(mode -rw-r-----\); run: chmod 600"
    ):
        certs.load_cluster_secret(secret)
    os.chmod(secret, 0o604)
    with pytest.raises(KeyFileError, match="can be read by others"):
        certs.load_cluster_secret(secret)
    os.chmod(secret, 0o600)
    with pytest.raises(KeyFileError, match=r"cluster\.pub: this is the cluster's public key; give its secret key file"):
        certs.load_cluster_secret(public)
    with pytest.raises(KeyFileError, match=r"cluster\.secret: this is the cluster's secret key; give its public key"):
        certs.load_cluster_public(secret)
    with pytest.raises(KeyFileError, match=r"missing\.pub: cannot read the cluster public key file"):
        certs.load_cluster_public(tmp_path / "missing.pub")
    with pytest.raises(KeyFileError, match="not a regular file"):
        certs.load_cluster_public(tmp_path)
    cases = {
        "garbage": b"hello\n",
        "two lines": public.read_bytes() * 2,
        "short key": b"dpwa-cluster-public AAAA\n",
        "bad base64": b"dpwa-cluster-public !!!!\n",
        "binary": b"\xff\xfe\n",
        "huge": b"#" * 5000 + b"\n",
    }
    for what, data in cases.items():
        path = tmp_path / f"{what}.pub"
        path.write_bytes(data)
        with pytest.raises(
            KeyFileError, match=rf"{what}\.pub: .*(expected one line 'dpwa-cluster-public BASE64'|one short line)"
        ):
            certs.load_cluster_public(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_secret_of_another_user_is_refused(tmp_path):
    _, secret = certs.generate_cluster_key(tmp_path)
    os.chown(secret, 54321, -1)
    with pytest.raises(KeyFileError, match="belongs to uid 54321, not to this user"):
        certs.load_cluster_secret(secret)


def test_write_cert_writes_only_certificates_and_replaces_only_when_told(tmp_path):
    path = certs.write_cert(tmp_path / "w1.cert", W1_CERT)
    assert path.read_text() == W1_CERT + "\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    renewed = certs.sign(CLUSTER, "w1", KEY, VALID_S, now=NOW + 1)
    with pytest.raises(FileExistsError, match=r"w1\.cert exists"):
        certs.write_cert(path, renewed)
    certs.write_cert(path, renewed, replace=True)
    assert path.read_text() == renewed + "\n"
    with pytest.raises(ValueError, match="unpadded base64url"):
        certs.write_cert(tmp_path / "bad.cert", "not a cert!")
    assert sorted(os.listdir(tmp_path)) == ["w1.cert"]


# --------------------------------------------------------------------------- the keygen commands


def test_keygen_makes_a_cluster_key_and_signs_a_member(tmp_path, capsys):
    admin, keys = tmp_path / "admin", tmp_path / "keys"
    assert cli.main(["keygen", "--cluster-key", "--dir", str(admin)]) == 0
    out = capsys.readouterr().out
    cluster_public = certs.load_cluster_public(admin / "cluster.pub")
    assert f"id {certs.key_id(cluster_public).hex()}" in out
    assert stat.S_IMODE(os.stat(admin / "cluster.secret").st_mode) == 0o600

    assert cli.main(["keygen", "w1", "--dir", str(keys), "--sign-with", str(admin / "cluster.secret")]) == 0
    out = capsys.readouterr().out.splitlines()
    cert = (keys / "w1.cert").read_text().strip()
    assert out[-1] == cert and "valid until" in out[0]
    assert sorted(os.listdir(keys)) == ["w1.cert", "w1.key", "w1.key_secret"]
    curve_public = zmq.auth.load_certificate(keys / "w1.key")[0].decode()
    fields = certs.decode(cert)
    assert fields.not_after - fields.issued_at == 30 * 86400  # the default validity
    assert certs.verify(cluster_public, cert, "w1", curve_public, fields.issued_at) == "ok"

    # again: the key and its certificate stay; --renew signs the same key anew, for --valid-days
    assert cli.main(["keygen", "w1", "--dir", str(keys), "--sign-with", str(admin / "cluster.secret")]) == 1
    assert "w1.cert exists; give --renew" in capsys.readouterr().err
    assert (keys / "w1.cert").read_text().strip() == cert
    argv = ["keygen", "w1", "--dir", str(keys), "--sign-with", str(admin / "cluster.secret"), "--renew"]
    assert cli.main([*argv, "--valid-days", "7"]) == 0
    renewed = (keys / "w1.cert").read_text().strip()
    assert capsys.readouterr().out.splitlines()[-1] == renewed
    fields = certs.decode(renewed)
    assert fields.not_after - fields.issued_at == 7 * 86400
    assert certs.verify(cluster_public, renewed, "w1", curve_public, fields.issued_at) == "ok"


def test_keygen_refuses_what_it_cannot_do_and_writes_nothing(tmp_path, capsys):
    admin, keys = tmp_path / "admin", tmp_path / "keys"
    certs.generate_cluster_key(admin)
    secret = str(admin / "cluster.secret")
    cases = [
        (["keygen", "w1", "--cluster-key"], "--cluster-key takes --dir only, not NAME"),
        (["keygen", "w1", "--valid-days", "3"], "--valid-days and --renew need --sign-with"),
        (["keygen", "w1", "--sign-with", secret, "--valid-days", "400", "--dir", str(keys)], "1 to 366 days"),
        (["keygen", "a/b", "--sign-with", secret, "--dir", str(keys)], "NAME must be 1 to 64"),
        (["keygen", "w1", "--sign-with", str(admin / "cluster.pub"), "--dir", str(keys)], "the cluster's public key"),
        (["keygen", "w1", "--sign-with", secret, "--renew", "--dir", str(keys)], r"w1.key: no such file"),
        (["keygen", "--config", "c.yaml", "--sign-with", secret], "give a NAME, not --config"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 1, argv
        assert message in capsys.readouterr().err, argv
    os.chmod(secret, 0o640)
    assert cli.main(["keygen", "w1", "--sign-with", secret, "--dir", str(keys)]) == 1
    assert "can be read by others" in capsys.readouterr().err
    assert not keys.exists()  # nothing was made for w1


@pytest.mark.io
def test_python_m_dpwa_keygen_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def dpwa(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "dpwa", "keygen", *args]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)

    made = dpwa("--cluster-key", "--dir", "admin")
    assert made.returncode == 0, made.stderr
    signed = dpwa("w2", "--dir", "keys", "--sign-with", "admin/cluster.secret", "--valid-days", "2")
    assert signed.returncode == 0, signed.stderr
    cert = Path(tmp_path / "keys" / "w2.cert").read_text().strip()
    assert signed.stdout.splitlines()[-1] == cert
    curve_public = zmq.auth.load_certificate(tmp_path / "keys" / "w2.key")[0].decode()
    cluster_public = certs.load_cluster_public(tmp_path / "admin" / "cluster.pub")
    fields = certs.decode(cert)
    assert fields.not_after - fields.issued_at == 2 * 86400
    assert certs.verify(cluster_public, cert, "w2", curve_public, fields.not_after) == "ok"
    assert certs.verify(cluster_public, cert, "w2", curve_public, fields.not_after + 1) == "expired"
