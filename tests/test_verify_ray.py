"""``ksim verify --cluster`` on a real Ray cluster: a head and one more node on
127.0.0.1 (``ray start``, one CPU each; no mock), the same verdicts as local
processes give for the same seed, then the cluster stopped (about a minute)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    from ksim.bench.verify import local_ray

    with local_ray(nodes=2, cpus=1) as address:
        yield address


def verify(*argv: str, env: dict[str, str] | None = None) -> dict:
    """``ksim verify ARGV --json`` in a process of its own (a Ray driver)."""
    done = subprocess.run([sys.executable, "-m", "ksim", "verify", *argv, "--json",
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return json.loads(done.stdout)


def test_toy_on_ray_as_on_local_processes(cluster, tmp_path):
    argv = ("--image", "toy", "--cases", "2", "--seed", "11")
    local = verify(*argv)
    results = tmp_path / "ray.jsonl"
    remote = verify(*argv, "--cluster", cluster, "--results", str(results))
    assert remote["engine"] == "ray" and local["engine"] == "local"
    assert remote["workers"] == 2  # the cluster's CPUs: one on each node
    assert remote["verdicts"] == local["verdicts"]
    for key in ("cases", "compared", "equivalent", "non_equivalent", "refused"):
        assert remote[key] == local[key], key
    assert remote["non_equivalent"] == 0
    assert len(results.read_text().splitlines()) == remote["cases"]
    # RAY_ADDRESS stands for --cluster; one task in flight gives the same verdicts
    env = {**os.environ, "RAY_ADDRESS": cluster}
    again = verify(*argv, "--workers", "1", env=env)
    assert again["engine"] == "ray" and again["workers"] == 1
    assert again["verdicts"] == local["verdicts"]


def test_debian_on_ray_as_on_local_processes(cluster, debian_kernel):
    argv = ("--sample", "200", "--seed", "4")
    local = verify(*argv)
    remote = verify(*argv, "--cluster", cluster)
    assert remote["verdicts"] == local["verdicts"]
    assert (remote["cases"], remote["equivalent"], remote["refused"]) == \
        (local["cases"], local["equivalent"], local["refused"])
    assert remote["non_equivalent"] == local["non_equivalent"] == 0


def test_an_unreachable_cluster(tmp_path):
    from ksim.bench.verify import free_port

    done = subprocess.run([sys.executable, "-m", "ksim", "verify", "--image", "toy", "--functions",
                           "kmalloc", "--cluster", f"127.0.0.1:{free_port()}", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert json.loads(done.stdout)["error"] == "cluster-unavailable"
