"""Packaging hook: the bundled kernel images' sources (``images/``) travel inside the
package as ``ksim/images/src/`` so that an installed (non-editable) ksim can build
them; everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCES = Path(__file__).resolve().parent / "images"


class BuildWithImages(build_py):
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "ksim" / "images" / "src"
        for path in sorted(SOURCES.rglob("*")):
            rel = path.relative_to(SOURCES)
            if path.is_file() and "build" not in rel.parts:
                self.mkpath(str((dest / rel).parent))
                self.copy_file(str(path), str(dest / rel))


setup(cmdclass={"build_py": BuildWithImages})
