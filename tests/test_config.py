"""Every named config describes one model, whichever tool reads it: train.py (its settings, tiny model
defaults underneath) and match.read_config (match.py, grow.py, tooling/memory.py; ModelConfig's defaults
underneath) must agree on what executes and on every count. Fields a layout ignores (n_loops of a plain
model, top_k of a dense one) may differ."""
import glob
import os

import pytest

import match
import train
from model import execution_plan
from tooling.settings import read_config_file

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "*.py")))


def test_there_are_named_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"smelt_200m_base.py", "smelt_200m_s95.py", "x_d8_vanilla.py", "x_d8_operator1.py",
            "x_d8_loop2.py", "x_d8_untied2.py", "x_d8_loop_grow.py", "x_d8_untied_grow.py"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_train_and_from_file_read_the_same_model(path):
    via_train = train.SETTINGS.build(train.ModelConfig, train.SETTINGS.resolve(read_config_file(path)))
    via_file, _ = match.read_config(path)
    assert execution_plan(via_train) == execution_plan(via_file)
    assert match.accounting(via_train) == match.accounting(via_file)
