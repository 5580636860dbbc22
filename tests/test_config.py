"""Every named config describes one model, whichever tool reads it: train.py (its settings, tiny model
defaults underneath) and ModelConfig.from_file (match.py, grow.py; dataclass defaults underneath) must
agree on what executes and on every count. Fields a layout ignores (n_loops of a plain model, top_k of
a dense one) may differ."""
import glob
import os

import pytest

import match
import train
from model import ModelConfig, execution_plan

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "*.py")))


def test_there_are_named_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"tiny.py", "smelt_200m_base.py", "smelt_200m_s95.py", "x_d8_vanilla.py", "x_d8_operator1.py",
            "x_d8_loop2.py", "x_d8_untied2.py", "x_d8_loop_grow.py", "x_d8_untied_grow.py"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_train_and_from_file_read_the_same_model(path):
    via_train = train.model_config_from(train.resolve_settings(train.read_config_file(path)))
    via_file = ModelConfig.from_file(path)
    assert execution_plan(via_train) == execution_plan(via_file)
    assert match.accounting(via_train) == match.accounting(via_file)


def test_tiny_config_is_the_train_default():
    assert train.model_config_from(train.resolve_settings({})) == \
        train.model_config_from(train.resolve_settings(train.read_config_file(
            [p for p in CONFIGS if p.endswith("tiny.py")][0])))
