"""``paratrain verify``: does a model train the same under every parallel layout?"""

from paratrain.verify.probe import Factorization, ProbeSetup
from paratrain.verify.replay import ReplayReport, verify_replay
from paratrain.verify.resume import ResumeReport, verify_resume
from paratrain.verify.runner import VerifyReport, verify

__all__ = ["Factorization", "ProbeSetup", "ReplayReport", "ResumeReport", "VerifyReport",
           "verify", "verify_replay", "verify_resume"]
