"""The one C part of cachefs: the 4 KiB read hit for pyfuse3's read hook (cachefs/_hit.c).

Optional: where it does not build, cachefs runs its Python hit path (hit.py) and says so.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cachefs._hit", ["cachefs/_hit.c"], optional=True)])
