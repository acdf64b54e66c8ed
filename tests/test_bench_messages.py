"""The benchmark's messages say what to do and what a figure is: an unknown ``--set`` field
names the closest one, a noisy run does not judge its targets, samples.json says its unit,
every plot has a footer with the date, the machine, the load and what a point is."""

from __future__ import annotations

import json
import re

import pytest

from shmclient_bench import report
from shmclient_bench import __main__ as bench


def test_set_with_an_unknown_field_names_the_closest_one(capsys):
    with pytest.raises(ValueError, match=r"no field 'spinus': did you mean 'spin_us'\?"):
        bench._base_config(["spinus=3"])
    with pytest.raises(ValueError, match=r"no field 'bogus': the fields are .*ring_capacity_bytes"):
        bench._base_config(["bogus=1"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        bench._base_config(["spin_us"])
    assert bench._base_config(["spin_us=3"]).spin_us == 3
    assert bench.main(["--set", "ring_capacity=65536", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "--set: EngineConfig has no field 'ring_capacity': did you mean 'ring_capacity_bytes'?" in err
