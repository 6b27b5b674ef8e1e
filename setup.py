"""Builds hixl's C hot path (hixl/_accel/_native.c); everything else is in pyproject.toml.

``optional=True``: where the extension cannot be built (no compiler), the install goes on
without it and hixl uses the pure-Python twin (see hixl/_accel/__init__.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hixl._accel._native",
            ["hixl/_accel/_native.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    ]
)
