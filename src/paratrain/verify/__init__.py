"""``paratrain verify``: does a model train the same under every parallel layout?"""

from paratrain.verify.probe import Factorization, ProbeSetup
from paratrain.verify.runner import VerifyReport, verify

__all__ = ["Factorization", "ProbeSetup", "VerifyReport", "verify"]
