"""Builds the codec's C kernels; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "atoll.wire._kernels",
            sources=["wire/_kernels.c"],
            # No fused multiply-add anywhere: decoded weights must be bit-identical on
            # every host that rebuilds them.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
        )
    ]
)
