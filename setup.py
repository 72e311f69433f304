"""Packaging beside ``pyproject.toml`` (which holds all metadata): maps the top-level folders under ``gyre``.

Each of ``PACKAGES``' folders becomes ``gyre.<folder>`` in a wheel and in an editable install, so the
project's import name is ``gyre`` while the repository keeps its layout. ``bench/`` and ``tests/`` run from a
checkout and are not installed. Folders without ``__init__.py`` (``deploy/recipes/``) ship as data.
"""

from setuptools import find_namespace_packages, setup

PACKAGES = ("services", "proto", "utils", "learner", "rollout", "replay", "deploy", "faults")

package_dir = {"gyre": "gyre"}
packages = ["gyre"]
for root in PACKAGES:
    package_dir[f"gyre.{root}"] = root
    packages += [f"gyre.{root}"] + [f"gyre.{root}.{sub}" for sub in find_namespace_packages(root, exclude=["*__pycache__*"])]

setup(package_dir=package_dir, packages=packages,
      package_data={"gyre.proto": ["*.proto", "*.pyi"], "gyre.deploy": ["*.yaml", "*.sbatch"],
                    "gyre.deploy.recipes": ["*.yaml"], "gyre.deploy.prometheus": ["*.yml"]})
