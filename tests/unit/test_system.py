"""System files (target/system.py): the built-ins load with a source for every number, link time follows the
bandwidth and latency, and a bad file is refused naming its field."""

from __future__ import annotations

import tomllib
from importlib import resources

import pytest

from tremula.errors import TremulaError
from tremula.target.system import builtin_system_names, load_system


def test_builtin_systems_load_and_cite_a_source_for_every_number():
    assert {"1xc600", "2xc600", "4xc600", "bow2000"} <= set(builtin_system_names())
    for name in builtin_system_names():
        s = load_system(name)
        data = tomllib.loads((resources.files("tremula") / "systems" / f"{name}.toml").read_text())
        for key, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert data.get(f"{key}_source"), (name, key)
        assert s.chips >= 1 and s.chip.name in ("c600", "bow")


def test_link_time_is_bytes_over_bandwidth_plus_latency_per_link():
    s = load_system("2xc600")
    clock = s.chip.clock_hz
    rate = s.link_bytes_per_second * s.link_efficiency
    assert s.link_cycles(0) == 0
    one = s.link_cycles(27_200_000)
    assert one == pytest.approx((27_200_000 / rate + s.link_latency_seconds) * clock, abs=1)
    assert s.link_cycles(27_200_000, hops=3) - one == pytest.approx(2 * s.link_latency_seconds * clock, abs=1)


def test_a_user_system_file_naming_a_chip_file_beside_it(tmp_path):
    chip = (resources.files("tremula") / "chips" / "mk2.toml").read_text()
    (tmp_path / "my_chip.toml").write_text(chip.replace('name = "mk2"', 'name = "mine"'))
    text = (resources.files("tremula") / "systems" / "2xc600.toml").read_text()
    path = tmp_path / "sys.toml"
    path.write_text(text.replace('chip = "c600"', 'chip = "my_chip.toml"').replace("chips = 2", "chips = 3"))
    s = load_system(str(path))
    assert s.chip.name == "mine" and s.chips == 3


@pytest.mark.parametrize("edit, field", [
    (("link_efficiency = 0.85", "link_efficiency = 1.5"), "link_efficiency"),
    (("chips = 2", "chips = 0"), "chips"),
    (("link_latency_seconds = 250e-9", "link_latency_seconds = -1.0"), "link_latency_seconds"),
    (("chips = 2", "chips = 2\nchipz = 3"), "chipz"),
    (('chip = "c600"', 'chip = "no-such-chip"'), "no-such-chip"),
])
def test_a_bad_system_file_is_refused_naming_the_field(tmp_path, edit, field):
    text = (resources.files("tremula") / "systems" / "2xc600.toml").read_text()
    assert edit[0] in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(TremulaError, match=field):
        load_system(str(path))


def test_unknown_system_name():
    with pytest.raises(TremulaError, match="built-in systems"):
        load_system("3xc600")
