"""TLS and mutual TLS on the gateway's public port, with a CA made here (`certs.py`).

One `loraserve up` stack (a LocalStack) serves mutual TLS: its start-up already shows that `up`'s
own health checks work through it. A lone gateway process serves plain TLS (no client certificate
asked). Bad PEM files are checked in-process for their messages, and as real processes for the
one-line error and exit code 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certs import CertificateAuthority, Issued
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidConfigError
from loraserve.gateway.tls import load_server_tls, load_up_client_tls
from loraserve.launcher.commands import add_arguments
from loraserve.launcher.up import gateway_tls
from loraserve.v1 import gateway_pb2, gateway_pb2_grpc

REFUSED = (grpc.StatusCode.UNAVAILABLE,)  # a failed handshake never reaches the server's handlers


class Pki:
    """A CA with a server and a client certificate, and a second CA the server does not know."""

    def __init__(self, directory: Path) -> None:
        self.ca = CertificateAuthority(directory, "good")
        self.other_ca = CertificateAuthority(directory, "other")
        self.server = self.ca.server("server")
        self.client = self.ca.client("client")
        self.stranger = self.other_ca.client("stranger")
        self.garbage = directory / "garbage.pem"
        self.garbage.write_text("not a certificate\n")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def secure(address: str, roots: Path, client: Issued | None = None) -> grpc.Channel:
    key, cert = (client.key.read_bytes(), client.cert.read_bytes()) if client else (None, None)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(roots.read_bytes(), key, cert))


def health(channel: grpc.Channel) -> health_pb2.HealthCheckResponse.ServingStatus:
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def refused(channel: grpc.Channel) -> grpc.StatusCode | None:
    """The status a health check over `channel` fails with (None: it was answered)."""
    try:
        health(channel)
    except grpc.RpcError as e:
        return e.code()
    return None


# ---- the checks of the PEM files, in-process ----------------------------------------------------


def test_tls_is_off_without_flags_and_on_with_a_matching_pair(pki: Pki):
    assert load_server_tls(None, None, None) is None
    tls = load_server_tls(pki.server.cert, pki.server.key, None)
    assert tls is not None and not tls.mutual
    assert load_server_tls(pki.server.cert, pki.server.key, pki.ca.cert).mutual


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("missing cert", "--tls-cert .*: cannot read it"),
        ("garbage cert", "--tls-cert .*garbage.pem: not a PEM certificate"),
        ("garbage key", "--tls-key .*garbage.pem: not a PEM private key"),
        ("cert as key", "--tls-key .*: not a PEM private key"),
        ("other key", "--tls-key .*client.key is not the key of --tls-cert"),
        ("encrypted key", "--tls-key .*: the key is encrypted"),
        ("cert only", "--tls-cert and --tls-key go together"),
        ("key only", "--tls-cert and --tls-key go together"),
        ("ca only", "--tls-client-ca needs TLS"),
        ("garbage ca", "--tls-client-ca .*garbage.pem: not a PEM certificate"),
        ("empty ca", "--tls-client-ca .*: not a PEM certificate"),
    ],
)
def test_a_bad_tls_file_is_refused_naming_its_flag(pki: Pki, tmp_path: Path, which: str, message: str):
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), None)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
    )
    encrypted.write_bytes(pem)
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    cert, key, ca = pki.server.cert, pki.server.key, None
    cert, key, ca = {
        "missing cert": (tmp_path / "nowhere.pem", key, ca),
        "garbage cert": (pki.garbage, key, ca),
        "garbage key": (cert, pki.garbage, ca),
        "cert as key": (cert, cert, ca),
        "other key": (cert, pki.client.key, ca),
        "encrypted key": (cert, encrypted, ca),
        "cert only": (cert, None, ca),
        "key only": (None, key, ca),
        "ca only": (None, None, pki.ca.cert),
        "garbage ca": (cert, key, pki.garbage),
        "empty ca": (cert, key, empty),
    }[which]
    with pytest.raises(InvalidConfigError, match=message):
        load_server_tls(cert, key, ca)


def _up_args(*argv: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def test_up_checks_its_gateway_with_the_gateway_certificate_and_needs_a_client_certificate_under_mtls(pki: Pki):
    tls = ["--tls-cert", pki.server.cert, "--tls-key", pki.server.key]
    assert gateway_tls(_up_args()) is None
    client = gateway_tls(_up_args(*tls))
    assert client is not None and client.roots == pki.server.cert.read_bytes() and client.cert_chain is None
    with pytest.raises(InvalidConfigError, match="--tls-client-cert and --tls-client-key"):
        gateway_tls(_up_args(*tls, "--tls-client-ca", pki.ca.cert))
    mutual = [*tls, "--tls-client-ca", pki.ca.cert, "--tls-client-cert", pki.client.cert]
    with pytest.raises(InvalidConfigError, match="go together"):
        gateway_tls(_up_args(*mutual))
    client = gateway_tls(_up_args(*mutual, "--tls-client-key", pki.client.key))
    assert client is not None and client.cert_chain == pki.client.cert.read_bytes()
    with pytest.raises(InvalidConfigError, match="--tls-client-ca"):
        gateway_tls(_up_args("--tls-client-cert", pki.client.cert, "--tls-client-key", pki.client.key))
    server = load_server_tls(pki.server.cert, pki.server.key, None)
    assert server is not None
    with pytest.raises(InvalidConfigError, match=r"--tls-client-key .* is not the key of --tls-client-cert"):
        load_up_client_tls(server, "localhost", pki.client.cert, pki.server.key)


# ---- real processes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "flags", "expected"),
    [
        ("gateway", ["--tls-cert", "{garbage}", "--tls-key", "{key}"], "--tls-cert"),
        ("gateway", ["--tls-cert", "{cert}", "--tls-key", "{missing}"], "--tls-key"),
        ("up", ["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{ca}"], "--tls-client-cert"),
    ],
)
def test_bad_tls_flags_stop_the_process_with_one_line_and_exit_code_1(pki: Pki, tmp_path, role, flags, expected):
    paths = {"garbage": pki.garbage, "key": pki.server.key, "cert": pki.server.cert, "ca": pki.ca.cert}
    paths["missing"] = tmp_path / "missing.key"
    port = free_port_block(1)
    command = [sys.executable, "-m", "loraserve.cli", role, "--bind", f"127.0.0.1:{port}"]
    done = subprocess.run(
        [*command, *(f.format(**paths) for f in flags)], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if expected in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.fixture(scope="module")
def tls_gateway(pki: Pki, tmp_path_factory) -> Iterator[str]:
    """A lone gateway serving plain TLS (no scheduler behind it: its health answers NOT_SERVING)."""
    log = tmp_path_factory.mktemp("tls-gateway") / "gateway.log"
    base = free_port_block(4)
    address = f"127.0.0.1:{base}"
    command = [sys.executable, "-m", "loraserve.cli", "gateway", "--bind", address]
    command += ["--scheduler", f"127.0.0.1:{base + 1}", "--store", f"127.0.0.1:{base + 2}"]
    command += ["--token-address", f"tcp://127.0.0.1:{base + 3}"]
    command += ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while refused(secure(address, pki.ca.cert)) is not None:
            assert process.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the TLS gateway did not answer in 60 s"
            time.sleep(0.2)
        yield address
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_tls_gateway_answers_a_client_that_trusts_its_ca_without_a_client_certificate(tls_gateway: str, pki: Pki):
    assert health(secure(tls_gateway, pki.ca.cert)) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_tls_gateway_refuses_plaintext_and_clients_that_do_not_trust_its_ca(tls_gateway: str, pki: Pki):
    assert refused(grpc.insecure_channel(tls_gateway)) in REFUSED
    assert refused(secure(tls_gateway, pki.other_ca.cert)) in REFUSED
    assert refused(secure(tls_gateway, pki.other_ca.cert, pki.stranger)) in REFUSED


@pytest.fixture(scope="module")
def mtls_stack(pki: Pki) -> Iterator[LocalStack]:
    """`up` with mutual TLS: its start waits for health checks that go through it."""
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        tls_client_ca=pki.ca.cert,
        tls_client_cert=pki.client.cert,
        tls_client_key=pki.client.key,
    )
    stack.start(timeout_s=120)
    yield stack
    stack.stop()


@pytest.mark.slow
def test_mtls_client_with_a_certificate_from_the_ca_generates_and_sees_health_and_reflection(
    mtls_stack: LocalStack, pki: Pki
):
    with secure(mtls_stack.address, pki.ca.cert, pki.client) as channel:
        api = gateway_pb2_grpc.LoraServeStub(channel)
        reply = api.Generate(gateway_pb2.GenerateRequest(adapter="upper", text="the quiet king", max_new_tokens=4))
        assert reply.text and 1 <= reply.usage.completion_tokens <= 4
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([ask]), timeout=5)
        assert "loraserve.v1.LoraServe" in {s.name for s in answer.list_services_response.service}
    gateway = mtls_stack.stack.roles["gateway"]
    assert gateway.check_health() == health_pb2.HealthCheckResponse.SERVING  # up's own check, over mTLS


@pytest.mark.slow
def test_mtls_refuses_plaintext_untrusting_clients_and_missing_or_foreign_client_certificates(
    mtls_stack: LocalStack, pki: Pki
):
    address = mtls_stack.address
    assert refused(grpc.insecure_channel(address)) in REFUSED
    assert refused(secure(address, pki.ca.cert)) in REFUSED  # no client certificate
    assert refused(secure(address, pki.ca.cert, pki.stranger)) in REFUSED  # one from another CA
    assert refused(secure(address, pki.other_ca.cert, pki.client)) in REFUSED  # the client does not trust the server
    assert refused(secure(address, pki.ca.cert, pki.client)) is None  # and the gateway still serves


@pytest.mark.slow
def test_up_show_demo_streams_through_its_mtls_gateway(pki: Pki):
    """`loraserve up` itself: the flags reach the gateway, and its health checks and demo use mTLS."""
    base = free_port_block(6)
    command = [sys.executable, "-m", "loraserve.cli", "up", "--base-port", str(base), "--bind", f"127.0.0.1:{base + 5}"]
    command += [
        "--tls-cert",
        str(pki.server.cert),
        "--tls-key",
        str(pki.server.key),
        "--tls-client-ca",
        str(pki.ca.cert),
    ]
    command += ["--tls-client-cert", str(pki.client.cert), "--tls-client-key", str(pki.client.key)]
    command += ["--show-demo", "--exit-after-demo", "--ready-timeout", "120"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "(mutual TLS)" in done.stdout and "finish reasons" in done.stdout, done.stdout[-3000:]
