"""DecodeSettings: the one settings type; checked on creation, frozen, picklable, and the
source of the allowed values ContextConfig and the CLI use."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from mtplib.errors import InputError
from mtplib.runtime.settings import (
    FLASH_ATTN_MODES,
    KV_TYPE_NAMES,
    ROW_SOURCES,
    DecodeSettings,
    SettingsError,
)


def test_defaults_are_the_c_api_and_mtplib_defaults():
    s = DecodeSettings()
    assert s.to_dict() == {"n_ctx": 2048, "n_batch": 512, "n_ubatch": 512, "n_threads": 2,
                           "kv_type": "f16", "flash_attn": "auto", "swa_full": True,
                           "hidden_rows": "auto"}
    assert KV_TYPE_NAMES == ("f16", "f32", "bf16", "q8_0")
    assert FLASH_ATTN_MODES == ("auto", "on", "off")
    assert ROW_SOURCES == ("auto", "api", "captured")


@pytest.mark.parametrize("field, value, allowed", [
    ("kv_type", "f8", "f16, f32, bf16, q8_0"),
    ("kv_type", "F16", "f16, f32, bf16, q8_0"),
    ("flash_attn", True, "auto, on, off"),
    ("flash_attn", "yes", "auto, on, off"),
    ("hidden_rows", "off", "auto, api, captured"),
])
def test_bad_choice_names_the_field_and_the_allowed_values(field, value, allowed):
    with pytest.raises(SettingsError, match=f"{field} {value!r} not in {allowed}"):
        DecodeSettings(**{field: value})


@pytest.mark.parametrize("field", ["n_ctx", "n_batch", "n_ubatch", "n_threads"])
@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True, None])
def test_counts_are_integers_at_least_one(field, value):
    with pytest.raises(SettingsError, match=f"{field} must be an integer >= 1"):
        DecodeSettings(**{field: value})


def test_every_problem_in_one_message_an_input_error():
    with pytest.raises(InputError) as e:
        DecodeSettings(n_ctx=0, kv_type="f8", swa_full="on")
    msg = str(e.value)
    assert "n_ctx" in msg and "kv_type" in msg and "swa_full must be true or false" in msg
    assert isinstance(e.value, ValueError)  # InputError: the CLI prints it on one line


def test_integer_like_counts_pass():
    np = pytest.importorskip("numpy")
    assert DecodeSettings(n_threads=np.int64(4)).n_threads == 4


def test_frozen_and_replace_checks_the_copy():
    s = DecodeSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n_ctx = 4  # type: ignore[misc]
    t = dataclasses.replace(s, n_ctx=512, kv_type="q8_0")
    assert (t.n_ctx, t.kv_type, s.n_ctx) == (512, "q8_0", 2048)
    with pytest.raises(SettingsError, match="flash_attn"):
        dataclasses.replace(s, flash_attn="maybe")
    assert hash(t) == hash(DecodeSettings(n_ctx=512, kv_type="q8_0"))


def test_round_trip_and_unknown_keys():
    s = DecodeSettings(n_ctx=333, n_batch=64, n_ubatch=16, n_threads=3, kv_type="bf16",
                       flash_attn="off", swa_full=False, hidden_rows="captured")
    assert DecodeSettings.from_dict(s.to_dict()) == s
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(SettingsError, match=r"unknown decode settings \['threads'\]"):
        DecodeSettings.from_dict({"threads": 2})


def test_engine_options_embed_the_settings_and_pickle():
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.sampling import Sampler

    o = EngineOptions(k=2, settings=DecodeSettings(n_ctx=256, hidden_rows="api"),
                      sampler=Sampler(0.8, 0.9, 3), trace=True)
    back = pickle.loads(pickle.dumps(o))  # it crosses into the ranged worker process
    assert back.settings == o.settings and back.k == 2 and back.trace
    assert EngineOptions().settings == DecodeSettings()
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    assert not names & {f.name for f in dataclasses.fields(DecodeSettings)}  # listed once


def test_context_config_from_settings_and_shared_allowed_values():
    from mtplib.runtime.model import FLASH_ATTN, KV_TYPES, ContextConfig, RuntimeInputError

    assert tuple(KV_TYPES) == KV_TYPE_NAMES and tuple(FLASH_ATTN) == FLASH_ATTN_MODES
    s = DecodeSettings(n_ctx=640, n_batch=128, n_ubatch=64, n_threads=1, kv_type="f32",
                       flash_attn="off", swa_full=False, hidden_rows="captured")
    c = ContextConfig.from_settings(s, mtp=True, nextn_rows="masked", n_rs_seq=2)
    assert (c.n_ctx, c.n_batch, c.n_ubatch, c.n_threads, c.kv_type, c.flash_attn,
            c.swa_full) == (640, 128, 64, 1, "f32", "off", False)
    assert (c.mtp, c.nextn_rows, c.n_rs_seq, c.n_seq_max) == (True, "masked", 2, 1)
    assert c.validate() is c
    with pytest.raises(RuntimeInputError, match="kv_type 'f8' not in f16, f32, bf16, q8_0"):
        ContextConfig(kv_type="f8").validate()


def test_mtp_runtime_refuses_unknown_keywords_before_loading():
    from mtplib.runtime.speculative import MTPRuntime

    with pytest.raises(TypeError, match="threads"):
        MTPRuntime("no-such.gguf", threads=2)
    with pytest.raises(SettingsError, match="kv_type"):
        MTPRuntime("no-such.gguf", kv_type="f8")


def test_cli_choices_come_from_the_settings():
    import argparse

    from mtplib.commands import check_hidden

    p = argparse.ArgumentParser()
    check_hidden.register(p.add_subparsers())
    sub = p._subparsers._group_actions[0].choices["check-hidden"]
    acts = {a.dest: a for a in sub._actions}
    assert tuple(acts["kv_type"].choices) == KV_TYPE_NAMES
    assert tuple(acts["flash_attn"].choices) == FLASH_ATTN_MODES


def test_one_source_for_the_seven_shared_context_fields():
    """DecodeSettings and ContextConfig share n_ctx..swa_full through ContextSettings: one
    definition, one default (n_threads included), one validator, one message."""
    from mtplib.runtime.model import ContextConfig, RuntimeInputError
    from mtplib.runtime.settings import ContextSettings, default_threads

    shared = [f.name for f in dataclasses.fields(ContextSettings)]
    assert shared == ["n_ctx", "n_batch", "n_ubatch", "n_threads", "kv_type", "flash_attn",
                      "swa_full"]
    assert issubclass(DecodeSettings, ContextSettings)
    assert issubclass(ContextConfig, ContextSettings)
    d, c = DecodeSettings(), ContextConfig()
    assert d.context_settings() == c.context_settings()
    assert c.n_threads == d.n_threads == default_threads()
    with pytest.raises(SettingsError, match="n_ubatch must be an integer >= 1, got 0"):
        DecodeSettings(n_ubatch=0)
    with pytest.raises(RuntimeInputError, match="n_ubatch must be an integer >= 1, got 0"):
        ContextConfig(n_ubatch=0).validate()
    with pytest.raises(RuntimeInputError, match="swa_full must be true or false"):
        ContextConfig(swa_full="yes").validate()
