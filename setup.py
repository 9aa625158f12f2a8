"""The package build: pyproject.toml says what the package is; this adds its native kernels.

Building a wheel (`python -m build`, or `pip install .`) compiles the kernel library for
every instruction-set level of this platform (llmserve/kernels/build.py's BUILDS) into the
package, so that it runs the native kernels wherever it is installed, without a C++
compiler; the wheel is then tagged for this platform. An editable install ships none (the
sources build on first use, as they change). LLMSERVE_PREBUILD_KERNELS=0 skips the
compilation (a pure-Python wheel whose kernels build where they are used).
"""

import importlib.util
import logging
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


def prebuilding() -> bool:
    return os.environ.get("LLMSERVE_PREBUILD_KERNELS", "1") != "0"


def kernel_build_module():
    """llmserve/kernels/build.py, loaded by path: the package's own `llmserve.kernels`
    imports torch, which a build environment does not have."""
    sys.path.insert(0, str(ROOT))  # for its `from llmserve import cpu_info` (no torch)
    spec = importlib.util.spec_from_file_location("llmserve_kernel_build",
                                                  ROOT / "llmserve" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode or not prebuilding():
            return
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        build = kernel_build_module()
        made = build.prebuild(Path(self.build_lib) / "llmserve" / "kernels")
        print(f"llmserve: native kernels built into the package: {', '.join(made) or 'none'}")


class PlatformWheel(bdist_wheel):
    """Tagged py3-none-<platform>: the kernels are native code, loaded by ctypes (no Python
    extension, so any CPython 3 of the platform runs them)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = not prebuilding()

    def get_tag(self):
        python, abi, platform = super().get_tag()
        return ("py3", "none", platform) if prebuilding() else (python, abi, platform)


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
