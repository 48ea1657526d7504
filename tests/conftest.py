"""Shared fixtures and hypothesis profiles.

    pytest                                  # the CI profile: a few hundred examples per property
    pytest --hypothesis-profile=long        # >= 10,000 examples per property
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=300, deadline=None)
settings.register_profile("long", max_examples=10_000, deadline=None)
settings.register_profile("dev", max_examples=20, deadline=None)


def pytest_configure(config):
    # --hypothesis-profile on the command line wins; otherwise the CI profile
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile(os.environ.get("KSIM_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def toy_path():
    from ksim import images

    return images.path("toy")


@pytest.fixture(scope="module")
def toy_manager(toy_path):
    from ksim.kapi import Manager

    m = Manager.attach("unicorn:toy")
    yield m
    m.detach()


@pytest.fixture(scope="session")
def debian_kernel():
    """Debian's 6.1 kernel (vmlinux, kallsyms, e100.ko, ext4.ko), fetched once into
    ~/.cache/ksim from the package registry; skipped where no registry answers."""
    from ksim.bench import kernel as kmod

    try:
        return kmod.debian_kernel()
    except kmod.KernelUnavailable as exc:  # pragma: no cover - no package registry
        pytest.skip(str(exc))
