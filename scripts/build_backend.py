"""setuptools' build backend, without its "Editable installation." notice.

setuptools emits that notice (an InformationOnly warning, which pip prints as a
BuildBackendWarning) on every editable install of a package whose folder is not named like it
(ptxattn is runtime/); it asks nothing of us. Every other warning still shows.
"""
import warnings

from setuptools.build_meta import *  # noqa: F401,F403 (the PEP 517 hooks)
from setuptools.warnings import InformationOnly

warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)
