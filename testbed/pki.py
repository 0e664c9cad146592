"""Certificates and keys for the local control plane, made with the openssl CLI.

One CA signs the API server's serving certificate and a client certificate
per identity. Identities are the ones kubeadm uses, so the default RBAC roles
of kube-controller-manager and kube-scheduler apply to them unchanged.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
DAYS = "3650"


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's file stem, user name (CN) and groups (O)."""

    stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = ClientIdentity("admin", "kubernetes-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("kube-controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("kube-scheduler", "system:kube-scheduler")
# KWOK plays every kubelet: it writes node and pod status for all fake nodes,
# which the Node authorizer would refuse to a single system:node identity.
KWOK = ClientIdentity("kwok", "kwok-controller", ("system:masters",))
# The API server's client identity towards aggregated API servers.
FRONT_PROXY = ClientIdentity("front-proxy-client", "front-proxy-client")
IDENTITIES = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, KWOK, FRONT_PROXY)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _subject(identity: ClientIdentity) -> str:
    return "".join(f"/O={group}" for group in identity.groups) + f"/CN={identity.user}"


def _sign(pki: Path, stem: str, subject: str, extensions: str) -> None:
    """Key + CSR for `stem`, signed by the CA with the given v3 extensions."""
    key, csr, crt, ext = (pki / f"{stem}.{s}" for s in ("key", "csr", "crt", "ext"))
    _openssl("genrsa", "-out", str(key), "2048")
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    ext.write_text(extensions)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-CAcreateserial", "-days", DAYS, "-sha256", "-extfile", str(ext), "-out", str(crt),
    )  # fmt: skip
    csr.unlink()
    ext.unlink()


def ensure_pki(pki: Path) -> None:
    """Create whatever of the CA, serving, client and service-account keys is missing."""
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        _openssl("genrsa", "-out", str(pki / "ca.key"), "2048")
        _openssl(
            "req", "-x509", "-new", "-key", str(pki / "ca.key"), "-subj", "/CN=topotrain-testbed-ca",
            "-days", DAYS, "-sha256", "-out", str(pki / "ca.crt"),
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip
    if not (pki / "apiserver.crt").exists():
        names = [
            "DNS:localhost", "IP:127.0.0.1", f"IP:{KUBERNETES_SERVICE_IP}", "DNS:kubernetes",
            "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]  # fmt: skip
        _sign(
            pki, "apiserver", "/CN=kube-apiserver",
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            f"subjectAltName={','.join(names)}\n",
        )  # fmt: skip
    for identity in IDENTITIES:
        if not (pki / f"{identity.stem}.crt").exists():
            _sign(
                pki, identity.stem, _subject(identity),
                "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
            )  # fmt: skip
    if not (pki / "sa.pub").exists():
        _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
        _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def ensure_serving_cert(pki: Path, stem: str, names: tuple[str, ...] = ("IP:127.0.0.1",)) -> None:
    """A serving certificate `stem`.crt/.key for `names` (subjectAltName entries), signed by the
    testbed CA, so the API server trusts a local webhook server with the CA it already has."""
    if (pki / f"{stem}.crt").exists() and (pki / f"{stem}.key").exists():
        return
    _sign(
        pki, stem, f"/CN={stem}",
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join(names)}\n",
    )  # fmt: skip
