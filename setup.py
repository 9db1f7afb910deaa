"""Package list only (everything else is in pyproject.toml).

`orttrainer.schemas` lives in the top-level schemas/ folder (package-dir in pyproject.toml), which
automatic discovery cannot see, so it is appended to the discovered orttrainer packages here.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["orttrainer", "orttrainer.*"]) + ["orttrainer.schemas"])
