"""What a clustered hub's routes must present: the cluster's user and password, over mutual
TLS with a certificate the cluster's own CA signed (`RouteAuth`).

A route is a way around every client's authorization (a peer sees all traffic). The CA is
made afresh each time the cluster is built, signs one certificate per node, and its private
key is dropped at once — it is never written to disk, so nothing outside this cluster can
ever be issued a certificate its nodes accept.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
from pathlib import Path

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from baton.stack.natsconf import HOST, RouteTls
from shared.credentials import Vault

ROUTE_USER = "baton-route"
CERT_DAYS = 825
"""Node certificates' lifetime (what browsers and Go still accept for a leaf certificate);
a stack started again gets new ones."""


class RouteAuth(msgspec.Struct, frozen=True, kw_only=True):
    """What a cluster's routes must present: `user` and `password` (generated into the
    stack's vault), and node certificates issued into `tls_dir` (owner-only)."""

    password: str
    tls_dir: Path
    user: str = ROUTE_USER

    @classmethod
    def in_vault(cls, root: Path) -> RouteAuth:
        """A stack's: the password in its vault at `root` (`route.secret`, generated once
        and kept), the node certificates under `root/routes` (made anew each start)."""
        password = Vault(root).secret("route").read_text().strip()
        return cls(password=password, tls_dir=root / "routes")


def issue_route_certs(directory: Path, nodes: int) -> list[RouteTls]:
    """A new CA (`ca.pem`) and, signed by it, node `i`'s certificate and key
    (`node-<i+1>.pem`, `node-<i+1>-key.pem`) in `directory`, replacing any there. Each node
    certificate serves both ends of a route (server and client auth) and names loopback
    and `hub-<i+1>`. The CA's key lives only in this call."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Baton hub routes CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = directory / "ca.pem"
    _write(ca_file, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    issued = []
    for i in range(nodes):
        name = f"hub-{i + 1}"
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        sans = [x509.DNSName(name), x509.DNSName("localhost"), x509.IPAddress(_LOOPBACK)]
        cert = (
            _builder(subject, ca_name, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_file, key_file = directory / f"node-{i + 1}.pem", directory / f"node-{i + 1}-key.pem"
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write(key_file, pem, 0o600)
        issued.append(RouteTls(cert_file=cert_file, key_file=key_file, ca_file=ca_file))
    return issued


_LOOPBACK = ipaddress.IPv4Address(HOST)
_CA_USAGE = x509.KeyUsage(
    key_cert_sign=True,
    crl_sign=True,
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)
"""A CA that signs certificates, and only that."""


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey, now: datetime.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        # A minute's slack for a peer whose clock is a little behind ours.
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """`data` into `path`, replacing it; `mode` from the file's first byte (a key is never
    readable by others, not even while it is written)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
