"""Every PARATRAIN_* variable is parsed once, by Settings, with one-line errors."""

import re
from pathlib import Path

import pytest

from paratrain.settings import VARIABLES, Settings, Straggler

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"


def test_defaults_without_variables():
    s = Settings.from_environ({})
    assert s == Settings()
    assert (s.health_every, s.wait_report_s, s.collective_warn_s, s.term_grace_s) == (50, 30.0, 60.0, 10.0)
    assert s.timeout_s is None and s.ps_servers is None and s.straggler is None


def test_values_are_parsed():
    s = Settings.from_environ({
        "PARATRAIN_ACCELERATOR": "cpu", "PARATRAIN_SHARE_GPUS": "1", "PARATRAIN_TIMEOUT_S": "12",
        "PARATRAIN_HEALTH_EVERY": "0", "PARATRAIN_TRACEBACK": "1", "PARATRAIN_LAUNCHED": "1",
        "PARATRAIN_PS_SERVERS": "2", "PARATRAIN_DATA_DIR": "/data", "PARATRAIN_STRAGGLER": "*:0.5:0.25",
        "PARATRAIN_KILL_RANK": "1", "PARATRAIN_KILL_AT_STEP": "7", "TORCHELASTIC_RESTART_COUNT": "2",
    })
    assert (s.accelerator, s.share_gpus, s.timeout_s, s.health_every) == ("cpu", True, 12.0, 0)
    assert s.show_traceback and s.launched and s.ps_servers == 2 and s.data_dir == "/data"
    assert s.straggler == Straggler(rank=None, seconds=0.5, probability=0.25)
    assert (s.kill_rank, s.kill_at_step, s.restart_count) == (1, 7, 2)
    assert Settings.from_environ({"PARATRAIN_ACCELERATOR": "auto"}).accelerator is None


@pytest.mark.parametrize("name,value", [
    ("PARATRAIN_ACCELERATOR", "tpu"), ("PARATRAIN_SHARE_GPUS", "maybe"),
    ("PARATRAIN_TIMEOUT_S", "-1"), ("PARATRAIN_WAIT_REPORT_S", "soon"),
    ("PARATRAIN_COLLECTIVE_WARN_S", "-2"), ("PARATRAIN_HEALTH_EVERY", "-1"),
    ("PARATRAIN_TERM_GRACE_S", "x"), ("PARATRAIN_PS_SERVERS", "0"),
    ("PARATRAIN_KILL_AT_STEP", "five"), ("PARATRAIN_STRAGGLER", "1"),
])
def test_bad_value_names_the_variable(name, value):
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        Settings.from_environ({name: value})


def test_only_settings_reads_paratrain_variables():
    """Other modules receive the values; they do not read PARATRAIN_* themselves."""
    reads = re.compile(r"""(environ|getenv)\S*\(\s*["']PARATRAIN_|environ\[["']PARATRAIN_""")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "settings.py" or "testing" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if reads.search(line) and "os.environ[" not in line.split("=")[0][-20:]:
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    # The launcher *sets* variables for its workers; setting is fine, reading is not.
    offenders = [o for o in offenders if "] = " not in o]
    assert not offenders, offenders


def test_every_variable_is_documented():
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    missing = [env for env, _ in VARIABLES.values() if env not in doc]
    assert not missing, f"docs/architecture.md lacks {missing}"


@pytest.mark.parametrize("name, line", [
    ("PARATRAIN_TIMEOUT_S", "PARATRAIN_TIMEOUT_S='inf' must be a finite number of seconds > 0 "
                            "(e.g. 86400 for a day)"),
    ("PARATRAIN_TERM_GRACE_S", "PARATRAIN_TERM_GRACE_S='inf' must be a finite number of seconds "
                               "> 0 (e.g. 86400 for a day)"),
    ("PARATRAIN_COLLECTIVE_WARN_S", "PARATRAIN_COLLECTIVE_WARN_S='inf' must be a finite number of "
                                    "seconds >= 0 (0 disables the stuck-collective report)"),
])
def test_infinite_seconds_are_refused(name, line):
    """inf passed the `> 0` check, then overflowed the process group's timedelta."""
    with pytest.raises(ValueError) as info:
        Settings.from_environ({name: "inf"})
    assert str(info.value) == line
