"""Certificates generated at test time (``cryptography``): a CA and certificates it signs, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def issue(subject: str, key, issuer_name, issuer_key, ca: bool = False, sans=(), usages=()) -> x509.Certificate:
    """A certificate for ``subject`` valid for a day, signed by ``issuer_key`` (self-signed without ``issuer_name``)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write(path: Path, cert, key=None) -> tuple[str, str | None]:
    """``{path}.crt`` (and ``{path}.key``, PKCS#8, unencrypted); returns their paths."""
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key")) if key is not None else None


def cluster_certs(folder: Path, ips: list[str]) -> dict[str, str]:
    """A CA and one cluster certificate (serverAuth + clientAuth; SANs ``localhost`` and ``ips``) in ``folder``:
    ``{"ca_file", "cert_file", "key_file"}`` as a recipe's ``security:`` section takes them."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("gyre test ca", ca_key, None, ca_key, ca=True)
    ca_file, _ = write(folder / "ca", ca)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(ips))]
    cert_file, key_file = write(folder / "cluster", issue("gyre cluster", key, ca.subject, ca_key, sans=sans, usages=[
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), key)
    return {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}
