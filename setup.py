"""Build of shmclient's C extension (the ring's per-message path); everything else is in
pyproject.toml."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Say what to install when the compiler or the Python headers are missing."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # distutils' CompileError / PlatformError / ...
            raise SystemExit(
                "shmclient needs to compile its C extension (shmclient/_ring.c) and could not: "
                f"{e}\nInstall a C compiler and the Python headers, e.g. on Debian/Ubuntu "
                "`apt-get install gcc python3-dev`, on Fedora/RHEL `dnf install gcc python3-devel`, "
                "on Alpine `apk add gcc musl-dev python3-dev`; then install again."
            ) from None


setup(
    ext_modules=[
        Extension(
            "shmclient._ring",
            ["shmclient/_ring.c"],
            depends=["shmclient/_spin_gate.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
