"""Shared fixtures and hypothesis profiles.

    pytest                                  # the CI profile: a few hundred examples per property
    pytest --hypothesis-profile=long        # >= 10,000 examples per property
"""

from __future__ import annotations

import os
import shutil

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


#: the toy kernel's builds that run in unicorn (the KernInst operations' tests run on each)
TOY_IMAGES = ("toy", "toy-arm64")
#: the cross compiler an image needs besides gcc
_COMPILERS = {"toy-arm64": "aarch64-linux-gnu-gcc"}


def needs_image(image: str) -> None:
    """Skip when the compiler ``image`` is built with is not installed."""
    compiler = _COMPILERS.get(image)
    if compiler is not None and shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed (apt-get install gcc-aarch64-linux-gnu)")


def toy_name(m, name: str) -> str:
    """What the image ``m`` is attached to calls the x86 toy's function ``name``."""
    from ksim import images

    return images.get(m.target.name.partition(":")[2]).local_name(name)


@pytest.fixture(scope="module", params=TOY_IMAGES)
def toy_image(request) -> str:
    """Each unicorn toy image in turn (a module's tests run on one, then the other)."""
    needs_image(request.param)
    return request.param


@pytest.fixture(scope="module")
def image_manager(toy_image):
    """A Manager on ``unicorn:IMAGE`` for each toy image, shared by a module's tests."""
    from ksim.kapi import Manager

    m = Manager.attach(f"unicorn:{toy_image}")
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
