"""Package discovery only; everything else is in pyproject.toml.

setuptools finds dlspark and its subpackages, and dlspark.compat in compat/
(mapped there by ``[tool.setuptools.package-dir]``) with its own subpackages,
so that a new subpackage ships without being listed by hand.
``[tool.setuptools.packages.find]`` in pyproject.toml cannot find a package
mapped to a directory outside its parent, hence this file.
"""

from setuptools import find_packages, setup

COMPAT = "dlspark.compat"

setup(packages=find_packages(include=["dlspark", "dlspark.*"])
      + [COMPAT] + [f"{COMPAT}.{p}" for p in find_packages("compat")])
