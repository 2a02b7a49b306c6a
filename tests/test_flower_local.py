"""``partialfl flower local`` without starting processes (issue 27): each SuperNode's own data
(a client store with only its partition's examples, the run's client ids), the generated
certificates and keys, and the command line's checks. The live federation is in
test_flower_live.py (slow)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "train" / "quickstart.toml"
TINY = ["data.num_clients=5", "data.holdout=1", "pretrain.rounds=2", "personalize.rounds=2",
        "pretrain.clients_per_round=3", "personalize.clients_per_round=3"]


@pytest.mark.data
def test_each_node_store_holds_only_its_clients_and_gives_the_same_updates(tmp_path, data_dir):
    import torch

    from partialfl.algorithms.base import RoundContext
    from partialfl.build import build
    from partialfl.flower.config import ConfigError, parse_run_config, partition_clients
    from partialfl.flower.local import node_view, write_node_stores
    from partialfl.flower.node import check_node_data, load_node_data
    from partialfl.flower.stage import node_parts
    from partialfl.flower.train import stage_run_config
    from partialfl.pipeline.train import load_run_spec

    spec = load_run_spec(QUICKSTART, [*TINY, f"data.path={data_dir}"])
    data = node_view(build(spec))
    paths = write_node_stores(data, 3, tmp_path)
    cfg = parse_run_config(stage_run_config(spec, "personalize"))
    full_problem, full_alg, theta = node_parts(cfg)
    for i, path in enumerate(paths):
        own = partition_clients(data.num_clients, 3, i)
        store = load_node_data(str(path))
        sizes = store.train_sizes() + store.test_sizes()
        assert list(store.client_ids) == list(data.client_ids)  # the run's client ids
        assert set(np.flatnonzero(sizes)) == set(own.tolist())  # examples of its own only
        for m in own:
            assert torch.equal(store.train_x[m], data.train_x[m])
        check_node_data(store, own)
        # the node's problem built from its store gives the in-process update of its clients
        problem, alg, theta0 = node_parts(cfg, store)
        ctx = RoundContext(cfg.seed, 0)
        u = alg.client_update(alg.init(problem, theta0), problem, own, ctx).updates
        ref = full_alg.client_update(full_alg.init(full_problem, theta), full_problem, own,
                                     ctx).updates
        for n in ref.vectors:
            assert torch.equal(u.vectors[n], ref.vectors[n]), (i, n)
    with pytest.raises(ConfigError, match=r"holds examples of clients \[0"):
        check_node_data(load_node_data(str(paths[0])), partition_clients(data.num_clients, 3,
                                                                          1))
    with pytest.raises(ConfigError, match="node-config 'data'"):
        load_node_data(str(tmp_path / "nope"))


def test_generated_credentials_chain_to_the_ca_and_keys_are_private(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        load_pem_private_key,
        load_ssh_private_key,
        load_ssh_public_key,
    )

    from partialfl.flower.certs import generate

    c = generate(tmp_path / "creds", 2, hosts=("127.0.0.1", "localhost", "link.example.org"))
    ca = x509.load_pem_x509_certificate(c.ca.read_bytes())
    cert = x509.load_pem_x509_certificate(c.server_cert.read_bytes())
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes,
                           ec.ECDSA(cert.signature_hash_algorithm))  # signed by the CA
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "link.example.org"}
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = load_pem_private_key(c.server_key.read_bytes(), None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    for i in range(2):
        priv = load_ssh_private_key(c.node_key(i).read_bytes(), None)  # what the node reads
        pub = load_ssh_public_key(c.node_public_key(i).read_bytes())  # what is registered
        assert isinstance(priv, ec.EllipticCurvePrivateKey)
        assert priv.public_key().public_numbers() == pub.public_numbers()
        assert os.stat(c.node_key(i)).st_mode & 0o777 == 0o600
    assert os.stat(c.server_key).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("argv, message", [
    (["flower", "local", str(QUICKSTART), "--nodes", "0"],
     "--nodes must be an integer in [1, 100000], got 0"),
    (["flower", "local", str(QUICKSTART), "--set", "method.algorithm='nope'"],
     "method.algorithm: 'nope' is not allowed"),
    (["train", str(QUICKSTART), "--flower", "secagg=true"],
     "--flower applies to --engine flower-sim / flower"),
    (["train", str(QUICKSTART), "--engine", "flower-sim", "--flower", "secagg.x=1"],
     "--flower secagg: Flower's own keys are not tables"),
    (["flower", "node-data", str(ROOT / "configs" / "ls-ffgg.toml"), "out"],
     "a closed-form problem is generated by every node"),
])
def test_flower_commands_check_their_input_before_anything_starts(argv, message, tmp_path,
                                                                  capsys, monkeypatch,
                                                                  data_dir):
    import subprocess

    from partialfl import cli

    def no_process(*args, **kw):
        raise AssertionError(f"a process was started: {args[0] if args else kw}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.chdir(tmp_path)
    rc = cli.main([*argv, "--set", f"data.path={data_dir}"] if "ls-ffgg" not in argv[2]
                  else argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_credentials_command_writes_a_ca_a_server_certificate_and_node_keys(tmp_path,
                                                                            capsys):
    from partialfl import cli

    assert cli.main(["flower", "credentials", str(tmp_path / "c"), "--nodes", "3",
                     "--host", "link.example.org"]) == 0
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["ca.crt", "server.key", "server.pem", *sorted(
        f"supernode-{i}.{e}" for i in range(3) for e in ("key", "pub"))]


def test_private_keys_are_owner_only_from_their_first_byte_and_stale_temps_go(tmp_path,
                                                                             monkeypatch):
    """A private key was written 0666 less the umask (0644) and chmod-ed to 0600 only after
    it had its name: a kill in between left a world-readable key, and a credentials run
    killed mid-write left its temp files for good (adversarial round 10). Now a key's
    temp file is 0600 until it is renamed, and the next run removes the temps a killed one
    left in the folder (not in its sub-folders)."""
    pytest.importorskip("cryptography")
    import os

    from partialfl.flower.certs import generate

    folder = tmp_path / "creds"
    (folder / "sub").mkdir(parents=True)
    stale = folder / ".supernode-0.key.abcd1234.tmp"
    stale.write_bytes(b"half a key")
    kept = folder / "sub" / ".notes.txt.abcd1234.tmp"
    kept.write_bytes(b"not ours")
    modes: dict[str, int] = {}
    real = os.replace

    def replace(src, dst, *a, **k):
        modes[os.path.basename(dst)] = os.stat(src).st_mode & 0o777
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    generate(folder, 2, hosts=("127.0.0.1",))
    assert {n: m for n, m in modes.items() if n.endswith(".key")} == {
        "server.key": 0o600, "supernode-0.key": 0o600, "supernode-1.key": 0o600}
    assert not stale.exists() and kept.exists()
